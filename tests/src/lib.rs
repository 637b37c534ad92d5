//! The test kit shared by the integration tests (`tests/`) and the benchmarks (`bench/`): real
//! memory-node processes and clusters ([`node`]), real FUSE mounts ([`mount`]), one fio runner
//! and parser ([`fio`]), the verbs conformance environments ([`mod@env`]), and small helpers.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod env;
pub mod fio;
pub mod locker;
pub mod map;
pub mod mount;
pub mod node;
pub mod process;
pub mod rng;
pub mod rpc_table;

pub use env::{connect, Env, NodeEnv, SimEnv, Via};
pub use fio::{Fio, FioJob, FioReport, FioSide};
pub use locker::Locker;
pub use map::mapped;
pub use mount::{pin, Mount};
pub use node::{MemNodeProcess, TestCluster};
pub use process::{bin_path, stop_process, wait_for, TempDir};
pub use rng::Rng;
