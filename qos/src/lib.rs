//! Haechi token QoS for one-sided I/O (`shared/papers/haechi-qos-one-sided-io.md`), extended
//! with pShift placement of reservations across memory nodes.
//!
//! The unit is the **token**: one one-sided data operation of up to 4 KiB ([`area::tokens_for`]).
//! Time is cut into QoS periods (default 1 s). Each memory node runs a [`monitor::QosMonitor`]:
//! at each period start it grants every mount its reservation share and puts the rest of its
//! estimated capacity in a global pool, a word of its region. Each mount runs a
//! [`engine::QosEngine`] per node: reservation tokens first, then global tokens taken by
//! remote FAA in batches from its share of the pool, which the monitor hands out to the mounts
//! that want it in proportion to their weights (PARDA-style shares of spare capacity); the
//! node's CPU never sees an I/O. Unused reservation decays
//! in proportion to the time left, and once the pool is being drained the monitor converts the
//! reservation mounts can no longer use back into pool tokens. [`estimate`] adapts the capacity
//! from what periods achieved; [`pshift`] splits a mount's reservation across nodes by its
//! demand on each.

pub mod area;
pub mod engine;
pub mod estimate;
pub mod monitor;
pub mod pshift;

pub use engine::{EngineConfig, QosEngine};
pub use estimate::CapacityEstimator;
pub use monitor::{MonitorConfig, MountShare, QosMonitor};
