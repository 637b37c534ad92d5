//! The errors of mounting and of `rackfs up`/`down`, as the CLI and `mount.rackfs` report them.

use std::path::PathBuf;
use std::process::ExitStatus;

use rackfs_proto::RpcError;
use rackfs_verbs::auth::SecretError;

use crate::cluster::ConnectError;
use crate::options::OptionsError;

/// Why a mount, `rackfs up` or `rackfs down` failed.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error(transparent)]
    Options(#[from] OptionsError),
    #[error("invalid cluster address {addr:?}: expected {expected}")]
    Address {
        addr: String,
        expected: &'static str,
    },
    #[error("mount point {}: {err}", .path.display())]
    MountPoint {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("mount point {} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error("mount point {} is busy: already mounted ({fs_source}, {fs_type})", .path.display())]
    Busy {
        path: PathBuf,
        fs_source: String,
        fs_type: String,
    },
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("QoS: {0}")]
    Qos(#[source] RpcError),
    #[error("cannot {what} {}: {err}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("FUSE session ended with an error: {0}")]
    Session(#[source] std::io::Error),
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    /// A daemon (`mount` in the background, `rackfs up --detach`) exited early.
    #[error("{what} failed ({status}): {last}")]
    Exited {
        what: &'static str,
        status: ExitStatus,
        last: String,
    },
    #[error("{what} did not {goal} within {secs} s; see {}", .log.display())]
    Timeout {
        what: String,
        goal: &'static str,
        secs: u64,
        log: PathBuf,
    },
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
}

/// An I/O error with what was being done to which path.
pub fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> FsError {
    let path = path.into();
    move |err| FsError::Io { what, path, err }
}
