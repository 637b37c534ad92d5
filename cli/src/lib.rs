//! `rackfs`, the operator's command: mount a cluster, run a local one (`up`, `down`), see what
//! it does (`status`), change a mount's QoS (`qos`). The mount itself is `rackfs-fs`'s; this
//! crate only drives it, so the client library carries no operator code.
//!
//! * [`args`]: the command line (clap), shared by the binary and [`generate`].
//! * [`up`]: a local cluster and its mount; its state files, which tests and benchmarks read.
//! * [`status`], [`qos`]: reports and settings through the control RPC.
//! * [`mod@out`]: stdout that ends a command quietly when its reader has gone.
//! * [`generate`]: man pages and shell completions.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod args;
pub mod error;
pub mod generate;
pub mod out;
pub mod qos;
pub mod status;
pub mod up;
