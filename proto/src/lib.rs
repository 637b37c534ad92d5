//! The compatibility contract between RackFS mounts and memory nodes: the control RPC
//! (requests, responses, typed errors, the client, and the [`link`]s both sides open control
//! connections through) and every format of remote memory that both sides read or write (file
//! records, extent tables, stripe tags, the lock-tree word). The QoS area's words are
//! `rackfs_qos::area`'s; the lock tree's own words are `rackfs_locks::tree`'s.
//!
//! [`PROTOCOL_VERSION`] names this contract; it is checked when a control connection opens.

pub mod client;
pub mod control;
pub mod coord;
pub mod link;
pub mod locktree;
pub mod namespace;
pub mod record;
pub mod size;
pub mod space;

pub use client::{ControlClient, RpcError};
pub use control::{ControlRequest, ControlResponse, ErrorCode, Refusal, PROTOCOL_VERSION};
