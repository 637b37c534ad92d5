//! The RackFS memory node: a region of DRAM served with one-sided verbs, plus the small control
//! plane (authentication, extent allocation, cluster membership, the metadata service,
//! statistics) that is the only place its CPU works for clients.

pub mod alloc;
pub mod control;
pub mod locktree;
pub mod meta;
pub mod metrics;
pub mod qos;
pub mod server;
pub mod size;

pub use control::{ControlClient, NodeStats, RpcError};
pub use server::{MemNode, NodeConfig, Role, StartError};
