//! The errors of mounting, as `rackfs mount`, `rackfs up` and `mount.rackfs` report them.

use std::path::PathBuf;
use std::process::ExitStatus;

use rackfs_proto::RpcError;
use rackfs_verbs::auth::SecretError;

use crate::cluster::ConnectError;
use crate::options::OptionsError;

/// Why a mount failed (or a daemon of one: a background mount, `rackfs up --detach`).
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
    #[error("cannot install signal handlers or start a thread: {0}")]
    Signals(#[source] std::io::Error),
    #[error("cannot serve metrics on {addr} (metrics=): {err}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        err: std::io::Error,
    },
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
}

/// An I/O error with what was being done to which path.
pub fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> FsError {
    let path = path.into();
    move |err| FsError::Io { what, path, err }
}
