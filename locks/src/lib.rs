//! Citron range locks on one-sided verbs (FAST'23, restated in `shared/papers/citron-protocol.md`).
//!
//! A request for units `[l, r)` is split into at most `k` nodes of a quaternary lock tree over
//! `[0, N)` ([`split`]), plus the spillover mutex for `[N, inf)`; each node is taken in four
//! phases ([`tree`]): (a) an internal node's bakery ticket, (b) waiting for occupied
//! ancestors, (c) occupying it (`Occ`) or setting its leaf bits, (d) notifying ancestors
//! (`DMax`) and, for an internal node, waiting `Twait` and then for notified descendants to drain
//! (`DCnt == DMax`). Lower nodes (smaller ranges) win. Release is one batch.
//!
//! ## Closing the gap of the restated protocol
//!
//! As restated, a notifier reaches its `m` nearest ancestors and a checker reads `m` levels of
//! descendants, so a lock more than `2m` levels below an occupied node goes unseen. Here a
//! notifier also notifies every ancestor on a **beacon level** — internal levels `1 <= l < h`
//! with `l % m == 0` — and a checker at level `x` checks its own counters and the internal levels
//! `x+1 ..= x+m`. Take any checker `A` at level `x` and descendant `D` at level `y > x`:
//! * if `y - x <= m`, `D` notifies `A` itself, and `A` checks its own `DCnt == DMax`;
//! * otherwise `y > x + m`, so levels `x+1 ..= x+m` all lie above `D`, are internal (they are
//!   below the root and above a node), and being `m` consecutive levels contain exactly one
//!   beacon level `b`; `D`'s ancestor at `b` is a descendant of `A` in `A`'s window, `D` notified
//!   it, and `A` reads it.
//!
//! Either way `A` sees `D`, for every tree height (`geometry::tests` checks every pair for
//! heights up to 10 and `m` up to 5). Timing: a notifier measures from before its ancestor read
//! to the completion of its notification and aborts past `Twait`; a checker waits `Twait` after
//! its `Occ` set completed before reading. A notifier whose ancestor read missed the checker's
//! `Occ` read before it landed, so its notification lands before the checker reads — or it
//! aborted. Clocks must advance at the same rate; they need not agree.
//!
//! ## No waiting while holding
//!
//! Taking the pieces of a request in ascending order does not by itself prevent deadlock with
//! hierarchical waits (a request holding piece X can wait in phase (b) on an ancestor Z whose
//! holder waits in phase (d) for X). Here only a request's first piece may wait; later pieces
//! only try — a ticket only if the node is free, leaf bits once — and on any conflict the request
//! gives back everything it holds and retries after a random backoff. Phase (d) waits only for
//! strictly deeper holders, so waits while holding form no cycle.
//!
//! Starvation: a request whose leaf bits keep being taken (`leaf_retries` attempts) escalates
//! to the leaf's parent, whose bakery ticket is fair.
//!
//! Growth, shrinking and recovery from clients that die holding locks all *replace* the tree
//! (see [`tree`]'s docs): the old tree is retired, a new one published, and acquisitions on a
//! retired tree fail with [`LockError::Retired`] so the caller retries on the new one.

pub mod geometry;
pub mod keep;
pub mod record;
pub mod split;
pub mod tree;

pub use geometry::{Geometry, Node};
pub use keep::{KeepBudget, KeepPolicy, Tick};
pub use tree::{LockConfig, LockError, LockTree, RangeGuard};
