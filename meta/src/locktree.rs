//! The lock-tree service: allocating, replacing and recovering the Citron lock trees of files
//! (the lock protocol itself is one-sided, in `rackfs_locks`).
//!
//! Each regular file may have one lock tree in the primary's region, published in its file
//! record as a [`TreeWord`] (written in the file record's lock word, [`rackfs_proto::record::REC_LOCKS`]) (0: none yet). The service is the only writer of that word and of
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
//! `grace` has passed (at least [`rackfs_proto::locktree::MIN_GRACE`]): clients re-read a tree's published word when
//! they have not seen it live for [`rackfs_proto::locktree::CLIENT_LEASE`], a quarter of that, so none touches freed
//! memory (an acquisition's first verb is its slot increment, before it can see `RETIRED`).

//!
//! Time comes from [`Storage::elapsed`], so the service runs under a simulated clock too.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use rackfs_locks::tree::{slot_offset, CLIENT_SLOTS, RETIRED, STATE_OFFSET};
use rackfs_locks::{Geometry, LockTree};
use rackfs_proto::control::ErrorCode;
use rackfs_proto::locktree::{TreeWord, MAX_HEIGHT, MIN_GRACE};
use rackfs_proto::Refusal;
use tracing::{info, warn};

use crate::storage::Storage;

fn geometry(w: TreeWord) -> (Geometry, u64) {
    let (height, base) = w.tree().expect("a published tree");
    (Geometry { height }, base)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Live(u64),
    /// The session ended; watched until then, reused after.
    Dead(Duration),
}

/// A retired tree waiting to be freed, or (retired by recovery) to be replaced first.
struct Retired {
    ino: u64,
    word: TreeWord,
    at: Duration,
    /// Slots live at retirement: the tree is quiet once they all read 0.
    watch: Vec<u16>,
}

/// Lock trees of the files of this node (see the module docs).
pub struct LockTrees {
    slots: Vec<Slot>,
    /// Published trees by inode, with the record holding the word.
    trees: HashMap<u64, (u64, TreeWord)>,
    /// Retired trees waiting out their grace, oldest first: every unlink adds one, and
    /// [`LockTrees::tick`] (every few milliseconds, under the metadata lock) looks only at the
    /// ones past their grace, not at all of them.
    retired: VecDeque<Retired>,
    /// Trees retired by recovery, to be replaced once quiet (then they wait in `retired`).
    recovering: Vec<Retired>,
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
            retired: VecDeque::new(),
            recovering: Vec::new(),
            dead_for,
            grace: grace.max(MIN_GRACE),
            recoveries: 0,
        }
    }

    /// The client slot of `session`, assigned on first request.
    pub fn attach(&mut self, session: u64) -> Result<u16, Refusal> {
        if let Some(i) = self.slots.iter().position(|s| *s == Slot::Live(session)) {
            return Ok(i as u16);
        }
        match self.slots.iter().position(|s| *s == Slot::Free) {
            Some(i) => {
                self.slots[i] = Slot::Live(session);
                Ok(i as u16)
            }
            None => Err(Refusal::new(
                ErrorCode::OutOfMemory,
                format!(
                    "all {CLIENT_SLOTS} lock client slots are in use (one per mount; slots of \
                     ended mounts are reused {:?} after they end)",
                    self.dead_for
                ),
            )),
        }
    }

    /// A session ended: its slot is dead (see the module docs). Returns the slot, if the
    /// session had one live.
    pub fn end_session(&mut self, session: u64, st: &dyn Storage) -> Option<u16> {
        let until = st.elapsed() + self.dead_for;
        let i = self.slots.iter().position(|s| *s == Slot::Live(session))?;
        self.slots[i] = Slot::Dead(until);
        Some(i as u16)
    }

    /// How long a dead slot is watched before it is reused.
    pub fn dead_for(&self) -> Duration {
        self.dead_for
    }

    fn live_slots(&self) -> Vec<u16> {
        (0..self.slots.len() as u16)
            .filter(|&i| matches!(self.slots[i as usize], Slot::Live(_)))
            .collect()
    }

    fn retire(&mut self, st: &dyn Storage, ino: u64, word: TreeWord, recover: bool) {
        let (_, base) = geometry(word);
        st.local()
            .1
            .store(base + STATE_OFFSET, RETIRED)
            .expect("tree in region");
        let r = Retired {
            ino,
            word,
            at: st.elapsed(),
            watch: self.live_slots(),
        };
        if recover {
            self.recovering.push(r);
        } else {
            self.wait_out_grace(r);
        }
    }

    fn alloc_tree(st: &dyn Storage, geo: Geometry) -> Result<TreeWord, Refusal> {
        // Plain extents come zeroed: a fresh tree with every lock free.
        let off = st.alloc(st.local().0, LockTree::memory_len(geo), None)?;
        Ok(TreeWord::new(geo.height, off))
    }

    fn free_tree(st: &dyn Storage, word: TreeWord) {
        let (_, base) = geometry(word);
        if let Err(e) = st.free(st.local().0, base, None) {
            warn!(offset = base, error = %e, "cannot free a retired lock tree");
        }
    }

    /// Publishes a tree covering at least `units` for file `ino` (record at `record`) in place
    /// of `old`, which the caller holds entirely (or [`TreeWord::NONE`]). If `old` is no longer
    /// the published tree, nothing changes. Returns the published word.
    pub fn publish(
        &mut self,
        st: &dyn Storage,
        ino: u64,
        record_word: u64,
        old: TreeWord,
        units: u64,
    ) -> Result<TreeWord, Refusal> {
        let region = st.local().1;
        let current = TreeWord(region.load(record_word).expect("record in region"));
        if current != old {
            return Ok(current);
        }
        let geo = Geometry::for_units(units.max(1));
        let geo = Geometry {
            height: geo.height.min(MAX_HEIGHT),
        };
        let new = Self::alloc_tree(st, geo)?;
        if old.tree().is_some() {
            self.retire(st, ino, old, false);
        }
        region.store(record_word, new.0).expect("record in region");
        self.trees.insert(ino, (record_word, new));
        Ok(new)
    }

    /// A primary that took over starts without trees: the file records it mirrored may still
    /// name trees in the old primary's region (a snapshot copies their lock words), which is
    /// not this node's, so each word goes back to [`TreeWord::NONE`] before anyone is served;
    /// a mount's next lock then publishes a fresh tree here.
    pub fn clear_words(&mut self, st: &dyn Storage, record_words: impl IntoIterator<Item = u64>) {
        let region = st.local().1;
        for w in record_words {
            region.store(w, TreeWord::NONE.0).expect("record in region");
        }
    }

    /// The file is gone: retire its tree (freed once quiet).
    pub fn forget(&mut self, st: &dyn Storage, ino: u64) {
        if let Some((_, w)) = self.trees.remove(&ino) {
            self.retire(st, ino, w, false);
        }
    }

    /// Bytes of lock trees currently allocated (published and retired).
    pub fn memory(&self) -> u64 {
        self.trees
            .values()
            .map(|(_, w)| w)
            .chain(self.retired.iter().chain(&self.recovering).map(|r| &r.word))
            .filter_map(|w| w.tree())
            .map(|(height, _)| LockTree::memory_len(Geometry { height }))
            .sum()
    }

    /// Recovery and reaping; called every few milliseconds.
    pub fn tick(&mut self, st: &dyn Storage) {
        let now = st.elapsed();
        let region = st.local().1;
        let quiet = |w: TreeWord, watch: &[u16]| {
            let (_, base) = geometry(w);
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
                let (_, base) = geometry(w);
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
                self.retire(st, ino, w, true);
            }
        }
        for s in &mut self.slots {
            if matches!(*s, Slot::Dead(until) if until <= now) {
                *s = Slot::Free;
            }
        }
        // Replace recovered trees once quiet; they wait out their grace like any other.
        for r in std::mem::take(&mut self.recovering) {
            if !quiet(r.word, &r.watch) {
                self.recovering.push(r);
                continue;
            }
            if let Some(&(record, w)) = self.trees.get(&r.ino) {
                if w == r.word {
                    let (geo, _) = geometry(w);
                    match Self::alloc_tree(st, geo) {
                        Ok(new) => {
                            region.store(record, new.0).expect("record in region");
                            self.trees.insert(r.ino, (record, new));
                            self.recoveries += 1;
                            info!(ino = r.ino, "lock tree recovered");
                        }
                        Err(e) => {
                            warn!(ino = r.ino, error = %e, "cannot allocate a recovered lock tree yet");
                            self.recovering.push(r);
                            continue;
                        }
                    }
                }
            }
            self.wait_out_grace(r);
        }
        // Free retired trees past their grace once quiet. Those are at the front; one a client
        // is still in stays there, ahead of the younger ones.
        let due = self.retired.partition_point(|r| now >= r.at + self.grace);
        let busy: Vec<Retired> = self
            .retired
            .drain(..due)
            .filter_map(|r| {
                if quiet(r.word, &r.watch) {
                    Self::free_tree(st, r.word);
                    None
                } else {
                    Some(r)
                }
            })
            .collect();
        for r in busy.into_iter().rev() {
            self.retired.push_front(r);
        }
    }

    /// Queues `r` to be freed past its grace, keeping `retired` oldest first.
    fn wait_out_grace(&mut self, r: Retired) {
        let i = self.retired.partition_point(|x| x.at <= r.at);
        self.retired.insert(i, r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    /// A deleted file's tree is freed only once its grace passed and the clients active in it
    /// when it was retired left it, whichever comes last.
    #[test]
    fn a_retired_tree_is_freed_after_its_grace_once_quiet() {
        let st = MemStorage::new(1, 16 << 20);
        let grace = Duration::from_secs(2);
        let mut trees = LockTrees::new(grace, grace);
        let c = trees.attach(7).unwrap();
        let (node, region) = st.local();
        let record = st.alloc(node, 64, None).unwrap();
        let w = trees.publish(&st, 5, record, TreeWord::NONE, 64).unwrap();
        let (_, base) = geometry(w);
        region.store(base + slot_offset(c), 1).unwrap();
        trees.forget(&st, 5);
        let used = st.used(node);
        st.advance(grace / 2);
        region.store(base + slot_offset(c), 0).unwrap();
        trees.tick(&st);
        assert_eq!(st.used(node), used, "quiet, but within its grace");
        region.store(base + slot_offset(c), 1).unwrap();
        st.advance(grace);
        trees.tick(&st);
        assert_eq!(
            st.used(node),
            used,
            "past its grace, but a client is still in it"
        );
        region.store(base + slot_offset(c), 0).unwrap();
        trees.tick(&st);
        assert!(st.used(node) < used, "past its grace and quiet: freed");
        assert!(trees.retired.is_empty());
    }

    /// Trees are freed in the order they were retired as each turns quiet: one a client is
    /// still in holds up none retired after it, and is freed once it is quiet; the ones whose
    /// grace has not passed stay.
    #[test]
    fn a_busy_retired_tree_holds_up_no_younger_one() {
        let st = MemStorage::new(1, 16 << 20);
        let grace = Duration::from_secs(2);
        let mut trees = LockTrees::new(grace, grace);
        let c = trees.attach(7).unwrap();
        let (node, region) = st.local();
        let mut bases = Vec::new();
        for ino in 1..=4 {
            let record = st.alloc(node, 64, None).unwrap();
            let w = trees.publish(&st, ino, record, TreeWord::NONE, 64).unwrap();
            bases.push(geometry(w).1);
        }
        let tree_len = |h| LockTree::memory_len(Geometry { height: h });
        let one = tree_len(geometry(trees.trees[&1].1).0.height);
        // The oldest retired tree has the client in it; the youngest is retired later.
        region.store(bases[0] + slot_offset(c), 1).unwrap();
        for ino in 1..=3 {
            trees.forget(&st, ino);
        }
        st.advance(grace / 2);
        trees.forget(&st, 4);
        let before = trees.memory();
        st.advance(grace / 2 + Duration::from_millis(1));
        trees.tick(&st);
        assert_eq!(
            trees.memory(),
            before - 2 * one,
            "the two quiet trees past their grace are freed, the busy one and the young one stay"
        );
        region.store(bases[0] + slot_offset(c), 0).unwrap();
        trees.tick(&st);
        assert_eq!(trees.memory(), before - 3 * one, "the busy one, once quiet");
        st.advance(grace);
        trees.tick(&st);
        assert_eq!(trees.memory(), 0, "and the young one past its grace");
        assert!(trees.retired.is_empty());
    }
}
