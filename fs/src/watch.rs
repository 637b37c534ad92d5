//! The mount's watcher: makes this mount's kernel forget names and attributes that other
//! mounts changed, before their operations return (see `rackfs_memnode::watch` for the
//! primary's side and the guarantee).
//!
//! A thread (started through the mount's [`crate::spawn::Spawn`]) polls the primary with `Watch` on a control connection of its own. For each
//! change it tells the kernel through fuser's notifier (`inval_entry`, `inval_inode`) and
//! drops what this mount's [`Caches`] knew of it, then acknowledges. A lost connection is logged with
//! the node's name and retried; meanwhile the primary stops waiting for this mount after its
//! `attr_timeout`, and the kernel's cache expires on its own.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::time::Duration;

use fuser::{INodeNo, Notifier};
use rackfs_proto::client::RPC_DEADLINE;
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::namespace::Change;
use tracing::{debug, warn};

use crate::caches::Caches;
use crate::cluster::Cluster;
use crate::link::ControlLink;

/// How long one poll waits for changes at the primary.
const POLL: Duration = Duration::from_secs(5);

/// Starts the watcher thread of a mount whose kernel caches for `ttl` (nothing to do when 0).
pub fn spawn(cluster: Arc<Cluster>, notifier: Notifier, caches: Caches, ttl: Duration) {
    if ttl.is_zero() {
        return;
    }
    let spawn = cluster.env().spawn.clone();
    let watcher = move || loop {
        // The mount's current session (a fenced mount starts a new one here).
        let of = cluster.primary_session().1;
        match cluster.connect_primary() {
            Ok(c) => match serve(&*c, of, ttl, &notifier, &caches) {
                rackfs_proto::RpcError::Refused {
                    code: ErrorCode::Fenced,
                    ..
                } => debug!(session = of, "the watcher's session was fenced"),
                e => {
                    warn!(node = c.node_name(), error = %e, "the watcher lost the primary; reconnecting")
                }
            },
            Err(e) => {
                warn!(error = %e, "the watcher cannot reach the primary; retrying");
                // An idle mount follows a primary that took over from here (its record
                // locks must be reclaimed within the new primary's grace period).
                if cluster.elects_primary() {
                    if let Err(e) = cluster.failover(of) {
                        warn!(error = %e, "no primary took over yet");
                    }
                }
            }
        }
        cluster.clock().sleep(Duration::from_secs(1));
    };
    let spawned = spawn.spawn("rackfs-watch", Box::new(watcher));
    if let Err(e) = spawned {
        warn!(error = %e, "no watcher thread");
    }
}

/// Polls and applies changes until the connection fails.
fn serve(
    c: &dyn ControlLink,
    of: u64,
    ttl: Duration,
    notifier: &Notifier,
    caches: &Caches,
) -> rackfs_proto::RpcError {
    c.set_deadline(POLL + RPC_DEADLINE);
    let mut acked = 0;
    loop {
        let req = ControlRequest::Watch {
            of,
            acked,
            ttl_ms: ttl.as_millis() as u64,
            poll_ms: POLL.as_millis() as u64,
        };
        match c.call(&req) {
            Ok(ControlResponse::Changes { seq, changes, lost }) => {
                if lost {
                    warn!("the primary dropped changes while this mount lagged");
                }
                for ch in &changes {
                    apply(ch, notifier, caches);
                }
                acked = seq;
            }
            Ok(other) => {
                return rackfs_proto::RpcError::Unexpected {
                    peer: c.peer().into(),
                    what: format!("{other:?} to Watch"),
                }
            }
            Err(e) => return e,
        }
    }
}

fn apply(ch: &Change, notifier: &Notifier, caches: &Caches) {
    caches.forget(ch);
    // ENOENT: the kernel had nothing cached for it, which is fine.
    let r = match ch {
        Change::Entry { parent, name } => {
            notifier.inval_entry(INodeNo(*parent), OsStr::from_bytes(name))
        }
        Change::Inode { ino } => notifier.inval_inode(INodeNo(*ino), 0, 0),
    };
    if let Err(e) = r {
        debug!(change = ?ch, error = %e, "kernel cache invalidation");
    }
}
