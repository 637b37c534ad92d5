//! The RackFS memory node daemon: a region of DRAM served with one-sided verbs, plus the small
//! control plane that is the only place its CPU works for clients.
//!
//! The daemon composes owned parts, each in its own module: [`store`] (region, allocator,
//! quarantine), [`membership`], [`counters`], [`qos`] (this node's monitor),
//! [`qos_controller`] (the primary's placement loop), [`baseline`] (the benchmark-only CPU lock
//! server), [`metrics`]; [`node`] puts them together behind the control RPC, [`conn`] serves
//! connections and [`daemon`] starts it all. The metadata service itself is `rackfs_meta`; the
//! wire contract is `rackfs_proto`.

pub mod alloc;
pub mod baseline;
pub mod config;
pub mod conn;
pub mod control;
pub mod coordinator;
pub mod counters;
pub mod daemon;
pub mod election;
pub mod epochs;
pub mod fence;
pub mod lease;
pub mod lease_words;
pub mod liveness;
pub mod membership;
pub mod metrics;
pub mod node;
pub mod qos;
pub mod qos_controller;
pub mod replicas;
pub mod standby;
pub mod standby_state;
pub mod store;
pub mod watch;

pub use config::{NodeConfig, Role};
pub use daemon::{MemNode, StartError};
