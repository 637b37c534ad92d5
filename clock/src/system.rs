//! The host's clocks: what a process's logic reads the operating system's time and sleeps on
//! through (the source scans in `fs/tests/core_isolation.rs` and
//! `memnode/tests/core_isolation.rs` hold the client core and the memory node to that).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Clock;

/// The host's monotonic clock (from when this was made) and wall clock; sleeps block.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> SystemClock {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn wall_ns(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}
