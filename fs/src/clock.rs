//! The time the client core takes: a [`Clock`] handed in by whoever builds the core (the
//! mount builds a [`SystemClock`], tests a [`ManualClock`]), never the host's clock read
//! directly. The clocks are `rackfs_clock`'s, shared with the memory node; re-exported here so
//! that the mount's users find them where they always were.

pub use rackfs_clock::*;
