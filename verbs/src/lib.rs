//! One-sided verbs for RackFS: READ, WRITE, CAS, FAA, masked CAS and masked FAA on memory
//! registered by a memory node, with RDMA's semantics over several transports.
//!
//! * [`QueuePair`] is the connection a client posts [`Batch`]es of [`WorkRequest`]s on. A batch
//!   costs one round trip; batches on one queue pair execute in posting order; many may be
//!   outstanding (pipelining); each request completes with its own status. [`Posted`] is both a
//!   future (for protocol code written `async`, which also runs under the simulator) and a
//!   blocking [`Posted::wait`].
//! * Transports: [`shm`] (colocated node, memfd mapping), [`tcp`] (a software NIC over TCP),
//!   [`rdma`] (RC queue pairs on an RDMA device, feature `rdma`), [`sim`] (deterministic
//!   simulation with virtual time and injected delays).
//! * Every request is checked against its region's key, bounds and access rights, and atomics
//!   must be 8-byte aligned ([`Region::check`]); a bad request fails alone and the rest of its
//!   batch is flushed, as on an RDMA queue pair.
//! * Connections authenticate with a cluster [`Secret`] by mutual challenge-response
//!   ([`auth`]); the framed wire protocol is in [`wire`].
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod auth;
pub mod counters;
mod error;
pub mod lease;
pub mod masked;
pub mod poll;
mod qp;
pub mod rdma;
pub mod region;
pub mod shm;
pub mod sim;
pub mod tcp;
pub mod wire;
mod wr;

pub use auth::Secret;
pub use counters::{VerbCounters, VerbTotals};
pub use error::VerbsError;
pub use qp::{block_on, Clock, Posted, QueuePair, Sleep};
pub use region::{Region, RegionInfo, RegionTable};
pub use wr::{
    Access, Batch, Completions, Opcode, RemoteAddr, WorkRequest, WrId, MAX_BATCH_BYTES,
    MAX_BATCH_REQUESTS,
};
