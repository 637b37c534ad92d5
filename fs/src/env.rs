//! What the client core takes from its surroundings instead of reaching for the operating
//! system itself: the time ([`crate::clock::Clock`]), control connections
//! ([`crate::link::Dial`]) and threads ([`crate::spawn::Spawn`]). A mount hands the core
//! [`Env::real`]; a test or a simulation hands it a virtual clock, in-process connections
//! ([`crate::link::Loopback`]) and threads it runs when it chooses ([`crate::spawn::Queue`]).

use std::sync::Arc;

use crate::clock::{SharedClock, SystemClock};
use crate::link::{Dial, NetDial};
use crate::spawn::{Spawn, Threads};

/// The client core's surroundings, shared by every part of one mount's core.
#[derive(Clone)]
pub struct Env {
    /// Where the core takes time from and sleeps on.
    pub clock: SharedClock,
    /// How the core opens control connections (to the primary, for the lease, the watcher,
    /// and to every node while it looks for a primary that took over).
    pub dial: Arc<dyn Dial>,
    /// How the core starts its threads (see [`crate::spawn`] for which).
    pub spawn: Arc<dyn Spawn>,
}

impl Env {
    /// The host's: its clocks, control connections over TCP or Unix sockets that poll for
    /// answers for `poll` before they sleep, OS threads.
    pub fn real(poll: std::time::Duration) -> Env {
        Env {
            clock: Arc::new(SystemClock::new()),
            dial: Arc::new(NetDial { poll }),
            spawn: Arc::new(Threads),
        }
    }
}
