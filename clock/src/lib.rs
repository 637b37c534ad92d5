//! Where RackFS's logic takes time, waits, locks and threads from: a [`Clock`] and a
//! [`Spawn`] handed in by whoever builds it, [`Mutex`]es and [`Bell`]s that work the same on
//! the host and in a simulated world, never the operating system's clock read directly, so
//! the client core (`rackfs_fs`), the memory node's logic (`rackfs_memnode`) and the
//! embedded coordinator (`rackfs_coord::Local`) run on virtual time under simulation and in
//! tests.
//!
//! Two readings: a monotonic one for ages, leases, back-offs and latencies ([`Clock::now`],
//! [`Clock::mono_ns`]), and the wall clock for the times stored in inodes ([`Clock::wall_ns`]).
//! Waiting is also the clock's ([`Clock::sleep`]): on a virtual clock a sleep moves time
//! forward instead of blocking.
//!
//! * [`SystemClock`]: the host's clocks; a process builds it where it starts (a mount, a
//!   memory node's daemon).
//! * [`ManualClock`]: time that moves only when told to (or slept through), for tests and
//!   single-threaded simulation.
//! * [`Turnstile`]: a simulated world's clock and scheduler: threads that run one at a time
//!   in an order a seed decides, on virtual time (see [`turnstile`]).
//!
//! Invariant: [`Clock::mono_ns`] is never 0 and never goes back, so atomics may use 0 for
//! "never".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod bell;
mod mutex;
pub mod spawn;
mod system;
pub mod turnstile;

pub use bell::Bell;
pub use mutex::{Mutex, MutexGuard};
pub use spawn::{Spawn, Threads, Work};
pub use system::SystemClock;
pub use turnstile::Turnstile;

/// Where time comes from (see the crate docs).
pub trait Clock: Send + Sync {
    /// Monotonic time since an arbitrary fixed origin (never goes back).
    fn now(&self) -> Duration;

    /// Wall-clock nanoseconds since the Unix epoch (mtimes, `utimensat(UTIME_NOW)`).
    fn wall_ns(&self) -> u64;

    /// Blocks the calling thread for `d` (a virtual clock advances by `d` instead).
    fn sleep(&self, d: Duration);

    /// [`Clock::now`] in nanoseconds, plus one so that it is never 0 (0 marks "never").
    fn mono_ns(&self) -> u64 {
        self.now().as_nanos() as u64 + 1
    }
}

/// A clock shared by everything that runs on it (a mount's core, a memory node's parts).
pub type SharedClock = Arc<dyn Clock>;

/// A clock that moves only when told: [`ManualClock::advance`], or a [`Clock::sleep`], which
/// returns at once having moved time forward by the sleep (so back-off loops end after the
/// virtual time they are meant to wait).
#[derive(Debug)]
pub struct ManualClock {
    /// Monotonic nanoseconds since the clock's origin.
    mono: AtomicU64,
    /// The wall clock at the origin, ns since the epoch.
    wall_origin: u64,
}

impl ManualClock {
    /// A clock at monotonic 0 whose wall clock reads `wall_origin_ns` (ns since the epoch).
    pub fn new(wall_origin_ns: u64) -> ManualClock {
        ManualClock {
            mono: AtomicU64::new(0),
            wall_origin: wall_origin_ns,
        }
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.mono.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    /// A clock whose wall time starts at 2024-01-01T00:00:00Z.
    fn default() -> ManualClock {
        ManualClock::new(1_704_067_200_000_000_000)
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.mono.load(Ordering::SeqCst))
    }

    fn wall_ns(&self) -> u64 {
        self.wall_origin + self.mono.load(Ordering::SeqCst)
    }

    fn sleep(&self, d: Duration) {
        self.advance(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_when_advanced_or_slept_through() {
        let c = ManualClock::new(1_000);
        assert_eq!(c.now(), Duration::ZERO);
        assert_eq!(c.mono_ns(), 1, "never 0");
        c.advance(Duration::from_millis(3));
        c.sleep(Duration::from_millis(2));
        assert_eq!(c.now(), Duration::from_millis(5));
        assert_eq!(c.mono_ns(), 5_000_001);
        assert_eq!(c.wall_ns(), 1_000 + 5_000_000);
    }
}
