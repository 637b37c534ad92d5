//! What the client core takes from its surroundings instead of reaching for the operating
//! system itself: the time ([`Clock`]). A mount hands the core [`Env::real`]; a test or a
//! simulation hands it a virtual clock.

use std::sync::Arc;

use crate::clock::{SharedClock, SystemClock};

/// The client core's surroundings, shared by every part of one mount's core.
#[derive(Clone)]
pub struct Env {
    /// Where the core takes time from and sleeps on.
    pub clock: SharedClock,
}

impl Env {
    /// The host's: its clocks.
    pub fn real() -> Env {
        Env {
            clock: Arc::new(SystemClock::new()),
        }
    }
}
