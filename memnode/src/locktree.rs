//! The memory node's part in Citron range locks: allocating, replacing and recovering the lock
//! trees of files (the lock protocol itself is one-sided, in `rackfs_locks`).
//!
//! Each regular file may have one lock tree in the primary's region, published in its file
//! record as a [`TreeWord`] (0: none yet). The service is the only writer of that word and of
//! every tree's `state` word; clients write the node words, the spillover mutex, the maximizer
//! and their own client slot. A tree is never resized: it is replaced (see `rackfs_locks::tree`):
//! * **create / grow / shrink**, on request ([`LockTrees::publish`]): the caller holds the
//!   whole old tree (growth and `ftruncate` take `[0, inf)`), so the service retires the old
//!   tree and publishes a new one at once;
//! * **recovery**: when a client session ends, its slot is *dead* for a while; every tree in
//!   which that slot is non-zero is retired, and once every slot that was live at retirement
//!   reads 0 a fresh tree of the same size is published. Dead slots are watched for
//!   [`LockTrees::new`]'s `dead_for`, so a dead client's verbs that were still queued on a
//!   connection when its session ended are caught too; only then is the slot reused.
//!
//! A retired tree's memory is freed once the slots that were live at its retirement read 0 and
//! `grace` has passed (at least [`MIN_GRACE`]): clients re-read a tree's published word when
//! they have not seen it live for [`CLIENT_LEASE`], a quarter of that, so none touches freed
//! memory (an acquisition's first verb is its slot increment, before it can see `RETIRED`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rackfs_locks::tree::{slot_offset, CLIENT_SLOTS, RETIRED, STATE_OFFSET};
use rackfs_locks::{Geometry, LockTree};
use rackfs_verbs::Region;
use tracing::{info, warn};

use crate::control::ErrorCode;

/// How long a client may use a tree handle without seeing the tree live.
pub const CLIENT_LEASE: Duration = Duration::from_millis(500);
/// The least time a retired tree stays allocated: four client leases.
pub const MIN_GRACE: Duration = Duration::from_secs(2);

/// Tallest tree the service builds: `64 * 4^9` units of 4 KiB = 64 GiB, 2.7 MiB of tree.
/// Beyond that a file's ranges are covered by the tree's spillover mutex.
pub const MAX_HEIGHT: u32 = 9;

/// A published tree: `1 << 63 | height << 56 | offset` in the primary's region (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeWord(pub u64);

impl TreeWord {
    pub const NONE: TreeWord = TreeWord(0);

    pub fn new(geo: Geometry, offset: u64) -> TreeWord {
        debug_assert!(offset < 1 << 56 && geo.height < 128);
        TreeWord(1 << 63 | (geo.height as u64) << 56 | offset)
    }

    /// The tree's shape and offset, if there is one.
    pub fn tree(self) -> Option<(Geometry, u64)> {
        (self.0 >> 63 == 1).then_some((
            Geometry {
                height: (self.0 >> 56 & 0x7f) as u32,
            },
            self.0 & ((1 << 56) - 1),
        ))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Live(u64),
    /// The session ended; watched until then, reused after.
    Dead(Instant),
}

/// A retired tree waiting to be freed, or (with `recover`) to be replaced first.
struct Retired {
    ino: u64,
    word: TreeWord,
    at: Instant,
    /// Slots live at retirement: the tree is quiet once they all read 0.
    watch: Vec<u16>,
    /// Retired by recovery: publish a fresh tree once quiet (if still the published one).
    recover: bool,
}

/// Memory the service needs: allocate and free plain extents in its own region.
pub trait TreeMemory {
    fn region(&self) -> &Region;
    fn alloc(&self, len: u64) -> Result<u64, (ErrorCode, String)>;
    fn free(&self, offset: u64);
}

/// Lock trees of the files of this node (see the module docs).
pub struct LockTrees {
    slots: Vec<Slot>,
    /// Published trees by inode, with the record holding the word.
    trees: HashMap<u64, (u64, TreeWord)>,
    retired: Vec<Retired>,
    dead_for: Duration,
    grace: Duration,
    /// Recoveries done (trees replaced because a client died in them).
    pub recoveries: u64,
}

impl LockTrees {
    pub fn new(dead_for: Duration, grace: Duration) -> LockTrees {
        LockTrees {
            slots: vec![Slot::Free; CLIENT_SLOTS as usize],
            trees: HashMap::new(),
            retired: Vec::new(),
            dead_for,
            grace: grace.max(MIN_GRACE),
            recoveries: 0,
        }
    }

    /// The client slot of `session`, assigned on first request.
    pub fn attach(&mut self, session: u64) -> Result<u16, (ErrorCode, String)> {
        if let Some(i) = self.slots.iter().position(|s| *s == Slot::Live(session)) {
            return Ok(i as u16);
        }
        match self.slots.iter().position(|s| *s == Slot::Free) {
            Some(i) => {
                self.slots[i] = Slot::Live(session);
                Ok(i as u16)
            }
            None => Err((
                ErrorCode::OutOfMemory,
                format!(
                    "all {CLIENT_SLOTS} lock client slots are in use (one per mount; slots of \
                     ended mounts are reused {:?} after they end)",
                    self.dead_for
                ),
            )),
        }
    }

    /// A session ended: its slot is dead (see the module docs).
    pub fn end_session(&mut self, session: u64) {
        for s in &mut self.slots {
            if *s == Slot::Live(session) {
                *s = Slot::Dead(Instant::now() + self.dead_for);
            }
        }
    }

    fn live_slots(&self) -> Vec<u16> {
        (0..self.slots.len() as u16)
            .filter(|&i| matches!(self.slots[i as usize], Slot::Live(_)))
            .collect()
    }

    fn retire(&mut self, mem: &dyn TreeMemory, ino: u64, word: TreeWord, recover: bool) {
        let (_, base) = word.tree().expect("a published tree");
        mem.region()
            .store(base + STATE_OFFSET, RETIRED)
            .expect("tree in region");
        self.retired.push(Retired {
            ino,
            word,
            at: Instant::now(),
            watch: self.live_slots(),
            recover,
        });
    }

    fn alloc_tree(mem: &dyn TreeMemory, geo: Geometry) -> Result<TreeWord, (ErrorCode, String)> {
        // Plain extents come zeroed: a fresh tree with every lock free.
        let off = mem.alloc(LockTree::memory_len(geo))?;
        Ok(TreeWord::new(geo, off))
    }

    /// Publishes a tree covering at least `units` for file `ino` (record at `record`) in place
    /// of `old`, which the caller holds entirely (or [`TreeWord::NONE`]). If `old` is no longer
    /// the published tree, nothing changes. Returns the published word.
    pub fn publish(
        &mut self,
        mem: &dyn TreeMemory,
        ino: u64,
        record_word: u64,
        old: TreeWord,
        units: u64,
    ) -> Result<TreeWord, (ErrorCode, String)> {
        let current = TreeWord(mem.region().load(record_word).expect("record in region"));
        if current != old {
            return Ok(current);
        }
        let geo = Geometry::for_units(units.max(1));
        let geo = Geometry {
            height: geo.height.min(MAX_HEIGHT),
        };
        let new = Self::alloc_tree(mem, geo)?;
        if old.tree().is_some() {
            self.retire(mem, ino, old, false);
        }
        mem.region()
            .store(record_word, new.0)
            .expect("record in region");
        self.trees.insert(ino, (record_word, new));
        Ok(new)
    }

    /// The file is gone: retire its tree (freed once quiet).
    pub fn forget(&mut self, mem: &dyn TreeMemory, ino: u64) {
        if let Some((_, w)) = self.trees.remove(&ino) {
            self.retire(mem, ino, w, false);
        }
    }

    /// Bytes of lock trees currently allocated (published and retired).
    pub fn memory(&self) -> u64 {
        self.trees
            .values()
            .map(|(_, w)| w)
            .chain(self.retired.iter().map(|r| &r.word))
            .filter_map(|w| w.tree())
            .map(|(g, _)| LockTree::memory_len(g))
            .sum()
    }

    /// Recovery and reaping; called every millisecond or so.
    pub fn tick(&mut self, mem: &dyn TreeMemory) {
        let now = Instant::now();
        let region = mem.region();
        let quiet = |w: TreeWord, watch: &[u16]| {
            let (_, base) = w.tree().expect("tree");
            watch
                .iter()
                .all(|&c| region.load(base + slot_offset(c)).expect("tree in region") == 0)
        };
        // Trees a dead client is (or may still be) active in: retire them for recovery.
        let dead: Vec<u16> = (0..self.slots.len() as u16)
            .filter(|&i| matches!(self.slots[i as usize], Slot::Dead(_)))
            .collect();
        if !dead.is_empty() {
            let mut hit = Vec::new();
            for (&ino, &(_, w)) in &self.trees {
                let (_, base) = w.tree().expect("tree");
                let retired = region.load(base + STATE_OFFSET).expect("tree") & RETIRED != 0;
                if !retired
                    && dead
                        .iter()
                        .any(|&c| region.load(base + slot_offset(c)).expect("tree in region") != 0)
                {
                    hit.push((ino, w));
                }
            }
            for (ino, w) in hit {
                info!(
                    ino,
                    "a client died inside this file's lock tree: recovering it"
                );
                self.retire(mem, ino, w, true);
            }
        }
        for s in &mut self.slots {
            if matches!(*s, Slot::Dead(until) if until <= now) {
                *s = Slot::Free;
            }
        }
        // Replace recovered trees once quiet; free retired trees once quiet and past grace.
        let mut keep = Vec::new();
        for r in std::mem::take(&mut self.retired) {
            if !quiet(r.word, &r.watch) {
                keep.push(r);
                continue;
            }
            if r.recover {
                if let Some(&(record, w)) = self.trees.get(&r.ino) {
                    if w == r.word {
                        let (geo, _) = w.tree().expect("tree");
                        match Self::alloc_tree(mem, geo) {
                            Ok(new) => {
                                region.store(record, new.0).expect("record in region");
                                self.trees.insert(r.ino, (record, new));
                                self.recoveries += 1;
                                info!(ino = r.ino, "lock tree recovered");
                            }
                            Err((_, e)) => {
                                warn!(ino = r.ino, error = %e, "cannot allocate a recovered lock tree yet");
                                keep.push(r);
                                continue;
                            }
                        }
                    }
                }
            }
            if now >= r.at + self.grace {
                let (_, base) = r.word.tree().expect("tree");
                mem.free(base);
            } else {
                keep.push(Retired {
                    recover: false,
                    ..r
                });
            }
        }
        self.retired = keep;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn tree_word_round_trips(height in 0u32..=MAX_HEIGHT, offset in 0u64..(1 << 56)) {
            let g = Geometry { height };
            prop_assert_eq!(TreeWord::new(g, offset).tree(), Some((g, offset)));
        }
    }

    #[test]
    fn none_has_no_tree() {
        assert_eq!(TreeWord::NONE.tree(), None);
    }
}
