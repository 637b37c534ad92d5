//! A memory node's lease to serve data, and the monotonic clock it is timed on.
//!
//! A node that is not the cluster's primary serves data only while the primary has renewed its
//! lease: it renews every quarter of the lease, timing each lease from when it *sent* the
//! renewal, and the primary declares it dead only a whole lease after it *received* the last
//! one. So by the time the primary drops a node from the stripes' replicas (and writes go on
//! without it), the node has stopped serving: a node that was stopped, partitioned or starved
//! never returns stale data. The check is on the serving side of every transport: a tcp NIC
//! thread checks before each batch; an shm client, which executes its own batches, checks the
//! word the node keeps in its counter block ([`crate::shm::LEASE_WORD`]). Both sides use
//! `CLOCK_MONOTONIC` (shm peers share a host, hence the clock).

use std::sync::atomic::{AtomicU64, Ordering};

/// Nanoseconds on `CLOCK_MONOTONIC` (the same clock for every process of a host).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, a live local; CLOCK_MONOTONIC
    // always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Until when (on [`monotonic_ns`]) a node may serve data; `u64::MAX` for a node that needs
/// no lease (the primary, a standalone node).
#[derive(Debug)]
pub struct ServeLease(AtomicU64);

impl ServeLease {
    /// A lease that never ends.
    pub fn forever() -> ServeLease {
        ServeLease(AtomicU64::new(u64::MAX))
    }

    /// A lease not granted yet.
    pub fn none() -> ServeLease {
        ServeLease(AtomicU64::new(0))
    }

    /// Extends the lease to `until` (never shortens it).
    pub fn extend_to(&self, until: u64) {
        self.0.fetch_max(until, Ordering::SeqCst);
    }

    /// Ends the lease now (the primary declared the node dead).
    pub fn end(&self) {
        self.0.store(0, Ordering::SeqCst);
    }

    /// Until when it holds.
    pub fn until(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// Whether the node may serve now.
    pub fn valid(&self) -> bool {
        valid_until(self.until())
    }
}

/// Whether a lease that holds until `until` holds now.
pub fn valid_until(until: u64) -> bool {
    until == u64::MAX || monotonic_ns() < until
}
