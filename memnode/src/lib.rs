//! The RackFS memory node daemon: a region of DRAM served with one-sided verbs, plus the small
//! control plane that is the only place its CPU works for clients.
//!
//! The daemon composes owned parts, each in its own module: [`store`] (region, allocator,
//! quarantine), [`membership`], [`counters`], [`qos`] (this node's monitor),
//! [`qos_controller`] (the primary's placement loop), [`baseline`] (the benchmark-only CPU lock
//! server), [`metrics`], and the state of the cluster's duties ([`lease_words`], [`epochs`],
//! [`replicas`], [`standby_state`], [`frees`]); [`node`] puts them together. Above it, [`liveness`] (data
//! nodes' leases) and [`standby`] (the metadata standby) drive the parts, [`control`] answers
//! the control RPC over all of them, [`conn`] serves connections and [`daemon`] starts it all
//! and carries out role changes (a standby taking over). The modules form a one-way chain: a
//! module uses only those below it (`tests/module_chain.rs` checks it). The metadata service
//! itself is `rackfs_meta`; the wire contract is `rackfs_proto`.
//!
//! The node's logic takes its time from a `rackfs_clock::Clock` handed in, never from the
//! operating system, and opens its control connections to other nodes through a
//! `rackfs_proto::link::Dial` handed in, never a socket of its own ([`MemNode::start_in`] with
//! a [`NodeEnv`]; the host's clock and network with [`MemNode::start`]), so that a simulation
//! can run whole clusters in one process on virtual time (`tests/core_isolation.rs` holds the
//! modules to that; `tests/in_process.rs` runs two nodes over a loopback).

pub mod alloc;
pub mod baseline;
pub mod config;
pub mod conn;
pub mod control;
pub mod coordinator;
pub mod counters;
pub mod daemon;
pub mod discover;
pub mod election;
pub mod epochs;
pub mod fence;
pub mod frees;
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
pub mod term;
pub mod watch;

pub use config::{NodeConfig, Role};
pub use daemon::{MemNode, NodeEnv, StartError};
