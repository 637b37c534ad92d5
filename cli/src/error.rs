//! Why a `rackfs` command failed, as it reports it (`rackfs: ...` on stderr, status 1).

use std::path::PathBuf;

use rackfs_fs::error::FsError;
use rackfs_fs::options::OptionsError;
use rackfs_proto::RpcError;
use rackfs_verbs::auth::SecretError;

/// The failures of `up`, `down`, `status` and `qos`; a mount's own are [`FsError`]s.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Fs(#[from] FsError),
    #[error(transparent)]
    Options(#[from] OptionsError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("etcd did not start: {0}")]
    Etcd(#[from] rackfs_coord::server::EtcdStartError),
    #[error("memory node {name} did not start: {last}")]
    NodeStart { name: String, last: String },
    #[error("RackFS is already up at {} (pid {pid}); run `rackfs down {}` first", .path.display(), .path.display())]
    AlreadyUp { path: PathBuf, pid: i32 },
    #[error("no RackFS started by `rackfs up` at {}", .0.display())]
    NotUp(PathBuf),
    #[error("corrupt state file {}", .0.display())]
    CorruptState(PathBuf),
    #[error("the rackfs up process {pid} for {} is gone; cleaned up its mount and state", .path.display())]
    Gone { path: PathBuf, pid: i32 },
    #[error("the rackfs up at {} (pid {pid}) is not running; `rackfs down {}` cleans up after it", .path.display(), .path.display())]
    Stale { path: PathBuf, pid: i32 },
    #[error("{}: {err}", .path.display())]
    Path {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("{} is not a RackFS mount", .0.display())]
    NotRackfs(PathBuf),
    #[error("{}: no record of this mount{hint}", .path.display())]
    NoRecord { path: PathBuf, hint: &'static str },
    #[error("{} was mounted with qos=off", .0.display())]
    QosOff(PathBuf),
    /// The cluster did not answer (or refused): `what` names it, e.g. the `rackfs up`
    /// instance whose state led there.
    #[error("{what}: {err}")]
    Cluster {
        what: String,
        #[source]
        err: RpcError,
    },
    #[error("the cluster has no QoS for slot {0} (is the mount still alive?)")]
    NoQosSlot(u16),
    #[error("{0}")]
    Settings(String),
    #[error("unexpected reply {0}")]
    Reply(String),
    #[error(transparent)]
    Rpc(#[from] RpcError),
    #[error("generate: cannot write {}: {err}", .path.display())]
    Generate {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
}
