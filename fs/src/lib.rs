//! The RackFS client: a FUSE filesystem whose file data lives on memory nodes and is read and
//! written with one-sided verbs.
//!
//! * [`client`]: the client core, one method per filesystem operation, and every policy of a
//!   mount (failover retries, set-user-ID clearing, O_APPEND, open handles, record locks).
//! * [`caches`]: what a mount keeps between requests (open files, attributes its own changes
//!   were answered with), forgotten on other mounts' changes; [`leased`]: what the mount
//!   answers itself while its watcher's lease runs (names absent from directories it made,
//!   names and attributes it learnt).
//! * [`cluster`]: the mount's connections (control to the primary, a queue pair per node).
//! * [`file`](mod@file): the data path of one file (layout cache, tag checks, size CAS-max).
//! * [`fuse`]: the FUSE adapter, kernel requests translated into [`client`] calls and back.
//! * [`lock`]: range locks on files (Citron trees on the primary) for writes and truncate.
//! * [`releases`]: last closes, told to the primary in batches.
//! * [`replica`]: which replica of a stripe a read goes to.
//! * [`layout`]: stripe arithmetic. [`options`]: mount options.
//! * [`clock`]: the time the core takes ([`clock::Clock`]); [`link`]: control connections
//!   ([`link::ControlLink`], opened by a [`link::Dial`]: the network's, or [`link::Loopback`] in
//!   process); [`spawn`]: the core's threads, started through a [`spawn::Spawn`]; [`env`](mod@env):
//!   everything the core takes from its surroundings instead of the operating system, handed
//!   in by the mount.
//! * [`mount`]: from a cluster address and options to a live FUSE session, in the foreground
//!   or as a daemon; the mount's record of its QoS slot. `rackfs` and `mount.rackfs` share it.
//!
//! Everything but [`fuse`] and [`mount`] is the *client core*: it reads no clock of the host,
//! never sleeps on it and starts no thread itself (it asks [`clock::Clock`] and
//! [`spawn::Spawn`], a rule `fs/tests/core_isolation.rs` enforces), and opens control connections
//! only through [`link::Dial`], so it runs on virtual time against an in-process cluster in
//! tests and under simulation.
//!
//! The operator commands (`rackfs up`, `down`, `status`, `qos`) live in `rackfs-cli`.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod caches;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod env;
pub mod error;
pub mod file;
pub mod fuse;
pub mod kept;
pub mod layout;
pub mod leased;
pub mod link;
pub mod lock;
pub mod metrics;
pub mod mount;
pub mod options;
pub mod reclock;
pub mod releases;
pub mod replica;
pub mod spawn;
pub mod watch;
