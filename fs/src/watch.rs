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
            Ok(c) => match serve(&*c, of, ttl, &cluster, &notifier, &caches) {
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

/// Polls and applies changes until the connection fails or the mount's session changes. A
/// poll is answered within a third of `ttl`, so the lease of what the mount answers itself
/// ([`crate::leased`]) runs on unbroken while the primary answers; each new connection, and
/// each answer saying changes were lost, starts that cache afresh.
fn serve(
    c: &dyn ControlLink,
    of: u64,
    ttl: Duration,
    cluster: &Cluster,
    notifier: &Notifier,
    caches: &Caches,
) -> rackfs_proto::RpcError {
    let clock = &**cluster.clock();
    let poll = POLL.min(ttl / 3);
    c.set_deadline(poll + RPC_DEADLINE);
    caches.forget_all();
    let mut acked = 0;
    // The first poll is answered at once, saying `lost` (the primary knows nothing of this
    // connection yet); the next, at once too, starts the lease.
    let mut wait = Duration::ZERO;
    let e = loop {
        if cluster.primary_session().1 != of {
            break rackfs_proto::RpcError::Refused {
                code: ErrorCode::Fenced,
                message: "the mount's session changed".into(),
            };
        }
        let first = acked == 0;
        let req = ControlRequest::Watch {
            of,
            acked,
            ttl_ms: ttl.as_millis() as u64,
            poll_ms: std::mem::replace(&mut wait, poll).as_millis() as u64,
            dropped: caches.leased.take_dropped(),
        };
        let sent = clock.mono_ns();
        match c.call(&req) {
            Ok(ControlResponse::Changes { seq, changes, lost }) => {
                // This mount's own caches first (no kernel lock needed), then the kernel's.
                for ch in &changes {
                    caches.forget(ch);
                }
                if lost {
                    if !first {
                        warn!("the primary dropped changes for this mount (it lagged, or a node's replicas moved): its caches start afresh");
                    }
                    // The lease starts again from the next poll, sent at once (this one's
                    // entry at the primary may be gone: nothing registered there since).
                    caches.forget_all();
                    wait = Duration::ZERO;
                } else {
                    caches.leased.renew(sent, ttl);
                }
                for ch in &changes {
                    invalidate(ch, notifier);
                }
                acked = seq;
            }
            Ok(other) => {
                break rackfs_proto::RpcError::Unexpected {
                    peer: c.peer().into(),
                    what: format!("{other:?} to Watch"),
                }
            }
            Err(e) => break e,
        }
    };
    caches.forget_all();
    e
}

/// Makes the kernel forget what `ch` changed.
fn invalidate(ch: &Change, notifier: &Notifier) {
    // ENOENT: the kernel had nothing cached for it, which is fine.
    let r = match ch {
        Change::Entry { parent, name } => {
            notifier.inval_entry(INodeNo(*parent), OsStr::from_bytes(name))
        }
        Change::Inode { ino } => notifier.inval_inode(INodeNo(*ino), 0, 0),
        // Its attributes only (a negative offset): the cached data stays.
        Change::Blocks { ino } => notifier.inval_inode(INodeNo(*ino), -1, 0),
        // The kernel caches no negative entries here: nothing to forget.
        Change::Created { .. } => return,
    };
    if let Err(e) = r {
        debug!(change = ?ch, error = %e, "kernel cache invalidation");
    }
}
