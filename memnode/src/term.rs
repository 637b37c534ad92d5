//! Deposed means silent: a primary acts only within the term its election gave it.
//!
//! A primary's *term* is its hold on the coordinator's `primary` key: the [`Guard`] (the key
//! under its election lease) and the *epoch* (the revision the key was created at, higher for
//! every later election). A primary stopped past its lease may resume and, for the moment
//! before it notices it was deposed, still run its duties; these rules make everything it then
//! tries fail instead of land:
//!
//! * **the coordinator**: every write the primary makes there (the `standby` key, mounts'
//!   keys) goes through [`rackfs_coord::Coordinator::write_if`] under its guard, so it lands
//!   only while the primary still holds its key; a revocation, which cannot be guarded in the
//!   same step, is made only once [`rackfs_coord::Coordinator::holds`] confirmed the term;
//! * **data nodes**: each connection a primary opens to a data node starts by declaring its
//!   epoch ([`ControlRequest::Primary`]); a data node keeps the newest epoch it has seen
//!   ([`Followed`]: from those declarations and from the `primary` key it reads with each lease
//!   renewal) and refuses a primary's actions (alloc, free, resize, zero, retag, pull, fence,
//!   mirror, journal) on a connection of an older epoch or of none;
//! * **itself**: the primary's duties (member checks, re-replication, fencing mounts, keeping a
//!   standby) run only while its own lease with the coordinator is valid.
//!
//! [`ControlRequest::Primary`]: rackfs_proto::control::ControlRequest::Primary

use std::collections::HashMap;
use std::sync::Arc;

use rackfs_clock::Mutex;
use rackfs_coord::{CoordError, Coordinator, Guard, Write};
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode, NodeAddr};
use rackfs_proto::link::{ControlLink, Dial};
use rackfs_proto::{Refusal, RpcError};
use rackfs_verbs::Secret;
use tracing::info;

/// The coordinator key the primary holds.
pub const PRIMARY_KEY: &str = "primary";

/// A primary's current term: its guard and epoch (none before it is elected).
#[derive(Default)]
pub struct Term(Mutex<Option<(Guard, u64)>>);

impl Term {
    /// Elected (again): writes from now on are guarded by holding the primary's key under
    /// `lease` (0: put without a lease, the embedded coordinator's), at `epoch`.
    pub fn begin(&self, lease: rackfs_coord::LeaseId, epoch: u64) {
        let guard = Guard {
            key: PRIMARY_KEY.into(),
            lease,
        };
        *self.0.lock().expect("term lock") = Some((guard, epoch));
    }

    /// The guard of the primary's coordinator writes (`None`: not a primary).
    pub fn guard(&self) -> Option<Guard> {
        self.0
            .lock()
            .expect("term lock")
            .as_ref()
            .map(|t| t.0.clone())
    }

    /// The epoch the primary declares to data nodes (0: not a primary).
    pub fn epoch(&self) -> u64 {
        self.0
            .lock()
            .expect("term lock")
            .as_ref()
            .map_or(0, |t| t.1)
    }
}

/// Makes `write` on `coord` only while `guard` holds; without a guard (not a primary) it is
/// refused as [`CoordError::NotHeld`] like a deposed primary's.
pub fn write_guarded(
    coord: &dyn Coordinator,
    guard: Option<&Guard>,
    write: Write,
) -> Result<(), CoordError> {
    match guard {
        Some(g) => coord.write_if(g, write),
        None => Err(CoordError::NotHeld {
            key: PRIMARY_KEY.into(),
            lease: 0,
        }),
    }
}

/// A control connection, opened through `dial`, to the data node at `addr` that speaks for
/// primary `node` of `epoch` (see the module docs).
pub fn connect(
    dial: &dyn Dial,
    addr: &str,
    secret: &Secret,
    name: &str,
    node: u32,
    epoch: u64,
) -> Result<Arc<dyn ControlLink>, RpcError> {
    declare(dial.connect(addr, secret, name)?, addr, node, epoch)
}

/// Declares on `c` (to `addr`) that it speaks for primary `node` of `epoch`.
fn declare(
    c: Arc<dyn ControlLink>,
    addr: &str,
    node: u32,
    epoch: u64,
) -> Result<Arc<dyn ControlLink>, RpcError> {
    match c.call(&ControlRequest::Primary { node, epoch })? {
        ControlResponse::Ok => Ok(c),
        other => Err(RpcError::Unexpected {
            peer: addr.into(),
            what: format!("{other:?}"),
        }),
    }
}

/// [`connect`] to the data node `to`: through its Unix socket when that is on this host and
/// answers as that node, else at its tcp address. Over loopback tcp a round trip costs a
/// softirq and mostly a wake-up on the other CPU more than over a Unix socket, and the journal
/// to a standby on the same host (as `rackfs up` runs it) pays that on every change: a 1-thread
/// small-file loop ran 1.3-1.8x faster on open and unlink with the journal on the socket. A
/// socket path here may also be stale, or another host's name for another node's socket,
/// hence the identity check (node ids are unique in a cluster).
pub fn connect_node(
    dial: &dyn Dial,
    to: &NodeAddr,
    secret: &Secret,
    name: &str,
    node: u32,
    epoch: u64,
) -> Result<Arc<dyn ControlLink>, RpcError> {
    if let Some(path) = &to.shm {
        let local = format!("unix:{path}");
        if let Ok(c) = dial.connect(&local, secret, name) {
            if c.node_id() == to.node_id && c.node_name() == to.name {
                return declare(c, &local, node, epoch);
            }
        }
    }
    let Some(tcp) = &to.tcp else {
        return Err(RpcError::Connection(rackfs_verbs::VerbsError::Connect {
            peer: to.name.clone(),
            reason: "no tcp address, and no node answers as it at its Unix socket here".into(),
        }));
    };
    connect(dial, tcp, secret, name, node, epoch)
}

/// A data node's view of primaries: the newest epoch it has seen, and the epoch each
/// connection of a primary declared.
#[derive(Default)]
pub struct Followed(Mutex<FollowedState>);

#[derive(Default)]
struct FollowedState {
    newest: u64,
    sessions: HashMap<u64, u64>,
}

impl Followed {
    /// The newest primary's epoch this node has seen.
    pub fn newest(&self) -> u64 {
        self.0.lock().expect("followed lock").newest
    }

    /// A primary of `epoch` exists (read from the coordinator or declared): older ones are
    /// deposed from now on.
    pub fn learn(&self, epoch: u64) {
        let mut s = self.0.lock().expect("followed lock");
        if epoch > s.newest {
            if s.newest != 0 {
                info!(
                    epoch,
                    before = s.newest,
                    "a newer primary's epoch: requests of earlier primaries are refused from now on"
                );
            }
            s.newest = epoch;
        }
    }

    /// Connection `session` speaks for primary `node` of `epoch`; refused if a newer primary
    /// is known.
    pub fn declare(&self, session: u64, node: u32, epoch: u64) -> Result<(), Refusal> {
        self.learn(epoch);
        let mut s = self.0.lock().expect("followed lock");
        if epoch < s.newest {
            return Err(deposed(node, epoch, s.newest));
        }
        s.sessions.insert(session, epoch);
        Ok(())
    }

    /// Whether connection `session` may have this node carry out a primary's action: it
    /// declared the newest epoch.
    pub fn check(&self, session: u64) -> Result<(), Refusal> {
        let s = self.0.lock().expect("followed lock");
        match s.sessions.get(&session) {
            Some(&e) if e >= s.newest => Ok(()),
            Some(&e) => Err(Refusal::new(
                ErrorCode::NotPrimary,
                format!(
                    "the primary of epoch {e} was deposed: this node follows the primary of epoch {}",
                    s.newest
                ),
            )),
            None => Err(Refusal::new(
                ErrorCode::NotPrimary,
                "only a primary that declared its epoch on this connection may ask a data node this",
            )),
        }
    }

    /// Connection `session` closed.
    pub fn end(&self, session: u64) {
        self.0
            .lock()
            .expect("followed lock")
            .sessions
            .remove(&session);
    }
}

fn deposed(node: u32, epoch: u64, newest: u64) -> Refusal {
    Refusal::new(
        ErrorCode::NotPrimary,
        format!(
            "node {node} speaks for the primary of epoch {epoch}, deposed: this node follows the primary of epoch {newest}"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_connections_of_the_newest_epoch_may_act() {
        let f = Followed::default();
        assert!(f.check(1).is_err(), "undeclared");
        f.declare(1, 0, 5).unwrap();
        f.check(1).unwrap();
        // A newer primary is learnt from the coordinator: the older connection is refused.
        f.learn(7);
        let e = f.check(1).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotPrimary);
        assert!(e.message.contains("epoch 5 was deposed"), "{}", e.message);
        // A deposed primary cannot declare itself again; the newer one can.
        assert!(f.declare(2, 0, 5).is_err());
        f.declare(3, 1, 7).unwrap();
        f.check(3).unwrap();
        // Learning an older epoch changes nothing.
        f.learn(6);
        f.check(3).unwrap();
        assert_eq!(f.newest(), 7);
        f.end(3);
        assert!(f.check(3).is_err());
    }

    #[test]
    fn a_term_guards_the_primary_key_under_its_lease() {
        let t = Term::default();
        assert_eq!((t.guard(), t.epoch()), (None, 0));
        t.begin(42, 9);
        assert_eq!(
            t.guard(),
            Some(Guard {
                key: PRIMARY_KEY.into(),
                lease: 42
            })
        );
        assert_eq!(t.epoch(), 9);
    }
}
