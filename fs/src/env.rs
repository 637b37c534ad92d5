//! What the client core takes from its surroundings instead of reaching for the operating
//! system itself: the time ([`crate::clock::Clock`]) and control connections
//! ([`crate::link::Dial`]). A mount hands the core [`Env::real`]; a test or a simulation hands
//! it a virtual clock and in-process connections ([`crate::link::Loopback`]).

use std::sync::Arc;

use crate::clock::{SharedClock, SystemClock};
use crate::link::{Dial, NetDial};

/// The client core's surroundings, shared by every part of one mount's core.
#[derive(Clone)]
pub struct Env {
    /// Where the core takes time from and sleeps on.
    pub clock: SharedClock,
    /// How the core opens control connections (to the primary, for the lease, the watcher,
    /// and to every node while it looks for a primary that took over).
    pub dial: Arc<dyn Dial>,
}

impl Env {
    /// The host's: its clocks, and control connections over TCP or Unix sockets.
    pub fn real() -> Env {
        Env {
            clock: Arc::new(SystemClock::new()),
            dial: Arc::new(NetDial),
        }
    }
}
