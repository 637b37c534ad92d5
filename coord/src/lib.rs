//! Cluster coordination: leases, a small key space and create-if-absent, the three things the
//! cluster map, node liveness and the primary's election are built on.
//!
//! [`Coordinator`] is the interface. [`Etcd`] puts it on a real etcd cluster (its v3 JSON
//! gateway, so the build needs neither protoc nor an async runtime); [`Local`] is the embedded
//! default, held by the primary in process, with the same semantics but no survival beyond it.
//!
//! Semantics every implementation keeps:
//! * a lease lapses `ttl` after its last renewal on the coordinator's clock, and every key put
//!   under it disappears then; a lapsed lease cannot be renewed ([`CoordError::Expired`]), so a
//!   holder that was cut off learns it was fenced and must start over with a new lease;
//! * the holder times its own lease from when it *sent* the renewal, so it believes itself
//!   live for no longer than the coordinator does;
//! * [`Coordinator::create`] puts a key only if it is absent, atomically: at most one caller
//!   wins while the key lives (the primary's election); it answers the key's *revision*, a
//!   number that grows with every write the coordinator takes, so a key created later has a
//!   higher one (the primary's epoch, which data nodes compare);
//! * [`Coordinator::write_if`] writes only while a [`Guard`] holds (a key still held under a
//!   given lease), atomically: a deposed holder's write never lands, however late it arrives.

mod etcd;
mod local;
pub mod server;

use std::time::Duration;

pub use etcd::Etcd;
pub use local::Local;
pub use server::EtcdServer;

/// A lease's id (etcd's lease id; never 0).
pub type LeaseId = i64;

/// Why a coordination call failed.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("coordinator unreachable ({endpoints}): {why}")]
    Unreachable { endpoints: String, why: String },
    #[error("lease {0:x} has lapsed")]
    Expired(LeaseId),
    #[error("coordinator at {endpoint} answered something unexpected: {what}")]
    Protocol { endpoint: String, what: String },
    #[error("key {key} is no longer held under lease {lease:x}: the write was not made")]
    NotHeld { key: String, lease: LeaseId },
}

/// What a guarded write requires: `key` exists, put under `lease` (0: put without a lease).
/// The primary's guard is its `primary` key under its election lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guard {
    pub key: String,
    pub lease: LeaseId,
}

/// One write, made only while a [`Guard`] holds ([`Coordinator::write_if`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
}

/// Leases, keys and create-if-absent (see the crate docs). Keys are relative to the
/// coordinator's cluster prefix.
pub trait Coordinator: Send + Sync {
    /// A new lease of about `ttl` (etcd rounds up to whole seconds and a minimum); returns it
    /// and the ttl granted.
    fn grant(&self, ttl: Duration) -> Result<(LeaseId, Duration), CoordError>;
    /// Renews `lease`; returns its ttl from now.
    fn keep_alive(&self, lease: LeaseId) -> Result<Duration, CoordError>;
    /// Ends `lease` now (its keys go).
    fn revoke(&self, lease: LeaseId) -> Result<(), CoordError>;
    /// Sets `key`, bound to `lease` if given.
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), CoordError>;
    /// Sets `key` only if it is absent: `Ok(revision)` (see the crate docs) when it did,
    /// `Err(value)` when the key is present, with its value.
    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Result<u64, Vec<u8>>, CoordError>;
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CoordError>;
    /// `key`'s value with the revision it was created at (its epoch), if present.
    fn created(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, CoordError>;
    /// Makes `write` only while `guard` holds, in one atomic step;
    /// [`CoordError::NotHeld`] when it does not (nothing is written).
    fn write_if(&self, guard: &Guard, write: Write) -> Result<(), CoordError>;
    /// Whether `guard` holds now.
    fn holds(&self, guard: &Guard) -> Result<bool, CoordError>;
    /// Every key starting with `prefix`, in key order, with its value.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CoordError>;
    fn delete(&self, key: &str) -> Result<(), CoordError>;
    /// Where it is, for logs and `rackfs status`.
    fn describe(&self) -> String;
}

/// A lease as its holder sees it: valid until one ttl after the *sending* of the last
/// renewal the coordinator answered. The coordinator times the lease from that renewal's
/// arrival, which is no earlier, so a holder never believes itself live once the coordinator
/// has let the lease go (and let another take its keys). Times are since any fixed start of
/// the holder's monotonic clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub lease: LeaseId,
    until: Duration,
}

impl Held {
    /// `lease`, granted (or created under) by a request sent at `sent`, for `ttl`.
    pub fn new(lease: LeaseId, sent: Duration, ttl: Duration) -> Held {
        Held {
            lease,
            until: sent + ttl,
        }
    }

    /// A renewal sent at `sent` was answered with `ttl`.
    pub fn renewed(&mut self, sent: Duration, ttl: Duration) {
        self.until = self.until.max(sent + ttl);
    }

    /// Whether the holder may act at `now`.
    pub fn valid(&self, now: Duration) -> bool {
        now < self.until
    }

    pub fn until(&self) -> Duration {
        self.until
    }
}

/// A key won by [`claim`]: the lease it is held under and the revision it was created at
/// (an epoch: a later winner's is higher).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claimed {
    pub held: Held,
    pub epoch: u64,
}

impl Claimed {
    /// The guard of writes made on the strength of holding `key`.
    pub fn guard(&self, key: &str) -> Guard {
        Guard {
            key: key.into(),
            lease: self.held.lease,
        }
    }
}

/// One try to take `key` for `value` under a new lease of `ttl` (an election's step), the
/// request sent at `sent` on the holder's clock: the key won, or the value holding it (the
/// new lease is revoked then).
pub fn claim(
    c: &dyn Coordinator,
    key: &str,
    value: &[u8],
    ttl: Duration,
    sent: Duration,
) -> Result<Result<Claimed, Vec<u8>>, CoordError> {
    let (lease, granted) = c.grant(ttl)?;
    match c.create(key, value, Some(lease)) {
        Ok(Ok(epoch)) => Ok(Ok(Claimed {
            held: Held::new(lease, sent, granted),
            epoch,
        })),
        other => {
            let _ = c.revoke(lease);
            other.map(|r| r.map(|_| unreachable!("handled above")))
        }
    }
}

/// Renews `held` by a renewal sent at `sent`; [`CoordError::Expired`] once the coordinator
/// has let it go (the holder must stop acting and start over).
pub fn renew(c: &dyn Coordinator, held: &mut Held, sent: Duration) -> Result<(), CoordError> {
    let ttl = c.keep_alive(held.lease)?;
    held.renewed(sent, ttl);
    Ok(())
}

/// How often a holder renews a lease of `ttl` (a quarter of it, at least every 10 ms).
pub fn renew_every(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(10))
}
