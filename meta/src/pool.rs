//! Stripe extents allocated ahead of need on the other data nodes, so that placing a new
//! file's first stripe costs no round trip to them while the metadata lock is held.
//!
//! A [`Slot`] is one serial and, on each other data node that had room when the slot was
//! made, an extent tagged `stripe_tag(serial, cap)`. A stripe placed from a slot carries that
//! tag on every replica ("every replica of a stripe carries one tag", which a take-over relies
//! on): its replica on this node is allocated then, with the same tag, and a node the slot has
//! no extent on gets an allocation of its own. Extents of the slot the placement did not use
//! are freed. Slots are made [`SLOTS`] at a time, with one [`Storage::alloc_many`] call per
//! node, when a placement finds none left; a node makes them only from memory free at once
//! (never waiting for quarantined extents, which the stripes that need memory wait for).
//!
//! The pool is namespace state: the step that refilled it is journaled with the offsets the
//! nodes answered, so a standby holds the same pool and a primary that takes over places
//! from it. A primary that dies between a refill and its journal leaves those extents
//! allocated (as it does any extent of a change it died in). A node declared dead loses its
//! pooled extents with its replicas ([`Pool::drop_node`]); they are freed on it with them
//! when it is admitted again. When a placement runs short of
//! memory, the pool gives all its extents back ([`Pool::give_back`]) and is not filled again
//! for the next [`HOLD_AFTER_GIVING_BACK`] creates.

use std::collections::{BTreeMap, VecDeque};

use rackfs_proto::record::stripe_tag;
use serde::{Deserialize, Serialize};

use crate::Storage;

/// Slots made per refill.
pub const SLOTS: u64 = 32;

/// One serial's pre-allocated extents (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    pub serial: u64,
    /// Base offset of the slot's extent on each node that has one.
    pub extents: BTreeMap<u32, u64>,
}

/// Slots by extent capacity (data bytes), oldest first.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    slots: BTreeMap<u64, VecDeque<Slot>>,
    /// Creates left that place without refilling: memory ran short lately.
    #[serde(default)]
    held: u64,
}

/// Creates that place without refilling the pool after it gave its extents back.
pub const HOLD_AFTER_GIVING_BACK: u64 = 1024;

impl Pool {
    /// A slot for an extent of `cap` data bytes, refilling first if none is left (serials
    /// from `next_serial`, which it advances). `None` when there is no other data node, or
    /// none could take an extent.
    pub fn take(&mut self, cap: u64, next_serial: &mut u64, st: &dyn Storage) -> Option<Slot> {
        if self.held > 0 {
            self.held -= 1;
            return None;
        }
        let queue = self.slots.entry(cap).or_default();
        if queue.is_empty() {
            let local = st.local().0;
            let others: Vec<u32> = st
                .data_nodes()
                .into_iter()
                .filter(|&n| n != local)
                .collect();
            if others.is_empty() {
                return None;
            }
            let first = *next_serial;
            *next_serial += SLOTS;
            let tags: Vec<u64> = (first..first + SLOTS).map(|s| stripe_tag(s, cap)).collect();
            let mut made: Vec<Slot> = (first..first + SLOTS)
                .map(|serial| Slot {
                    serial,
                    extents: BTreeMap::new(),
                })
                .collect();
            for node in others {
                match st.alloc_many(node, cap, &tags) {
                    Ok(bases) => {
                        for (slot, base) in made.iter_mut().zip(bases) {
                            slot.extents.insert(node, base);
                        }
                    }
                    Err(e) => {
                        tracing::debug!(node, error = %e, "no extents placed ahead on a node")
                    }
                }
            }
            queue.extend(made.into_iter().filter(|s| !s.extents.is_empty()));
        }
        queue.pop_front()
    }

    /// Node `node` is out of the cluster: its pooled extents leave the pool. Returns them
    /// (base, tag), for the node to free when it is admitted again.
    pub fn drop_node(&mut self, node: u32) -> Vec<(u64, u64)> {
        let mut dropped = Vec::new();
        for (&cap, queue) in self.slots.iter_mut() {
            for slot in queue.iter_mut() {
                if let Some(base) = slot.extents.remove(&node) {
                    dropped.push((base, stripe_tag(slot.serial, cap)));
                }
            }
            queue.retain(|s| !s.extents.is_empty());
        }
        dropped
    }

    /// Frees every pooled extent (memory ran short: stripes need it more).
    pub fn give_back(&mut self, st: &dyn Storage) {
        self.held = HOLD_AFTER_GIVING_BACK;
        for (cap, queue) in std::mem::take(&mut self.slots) {
            for slot in queue {
                let tag = stripe_tag(slot.serial, cap);
                for (node, base) in slot.extents {
                    if let Err(e) = st.free(node, base, Some(tag)) {
                        tracing::warn!(node, base, error = %e, "a pooled extent stays allocated");
                    }
                }
            }
        }
    }

    /// Node memory the pooled extents hold (data bytes, tags aside).
    pub fn bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|(cap, q)| cap * q.iter().map(|s| s.extents.len() as u64).sum::<u64>())
            .sum()
    }
}
