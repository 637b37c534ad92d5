//! A regular file's layout as the service keeps it: its record, its extent table and the
//! replicas of its stripes.
//!
//! [`File`] is the only writer of the record's table words and of the table, and writes them
//! in the order `rackfs_proto::record` states: a slot's location then its tag when a replica
//! is placed, its tag then its location when one is freed or dropped; a new table is filled
//! before the record points at it. Every replica of a stripe is on a different node, shares
//! the stripe's tag and capacity, and holds the same bytes (mounts write all of them under the
//! range lock). When a node is declared dead its replicas are dropped from every stripe that
//! has another; a stripe's last replica is never dropped, so a stripe whose every copy is gone
//! fails to read instead of reading as a hole.
//!
//! A stripe's extents hold only the bytes written to it so far ([`extent_cap`]): the first
//! stripe of a file grows by moving to extents at least twice as large, later stripes are
//! allocated whole, and when the last open of a file closes its last stripe is trimmed to the
//! file's size.

use std::collections::{BTreeMap, BTreeSet};

use rackfs_proto::control::ErrorCode;
use rackfs_proto::namespace::StripeExtent;
use rackfs_proto::record::{
    entry_offset, location, stripe_tag, tag_serial, ENTRY_LEN, EXTENT_GRANULE, MAX_REPLICAS,
    RECORD_LEN, REC_REPLICAS, REC_SIZE, REC_TABLE, REC_TABLE_CAP, TAG_MOVING, TAG_SPACE,
};
use rackfs_proto::Refusal;
use rackfs_verbs::Region;
use serde::{Deserialize, Serialize};

use crate::pool::Slot;
use crate::storage::Storage;

type MetaResult<T> = Result<T, Refusal>;

/// One stripe's replicas, by table slot (`None`: an empty slot).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replicas(Vec<Option<StripeExtent>>);

impl Replicas {
    /// The live replicas' extents.
    pub fn live(&self) -> Vec<StripeExtent> {
        self.0.iter().flatten().copied().collect()
    }

    /// Data bytes each replica holds.
    pub fn cap(&self) -> u64 {
        self.0.iter().flatten().next().map_or(0, StripeExtent::cap)
    }

    /// Node memory the replicas hold.
    fn memory(&self) -> u64 {
        self.0.iter().flatten().map(StripeExtent::cap).sum()
    }

    fn on(&self, node: u32) -> Option<usize> {
        self.0
            .iter()
            .position(|s| s.is_some_and(|e| e.node == node))
    }
}

/// A regular file's record, extent table and stripes (see the module docs).
#[derive(Serialize, Deserialize)]
pub struct File {
    pub record: u64,
    pub stripe_unit: u64,
    /// Copies of every stripe the file asks for (fewer when fewer nodes could take them).
    pub replicas: u32,
    table: u64,
    table_cap: u64,
    stripes: BTreeMap<u64, Replicas>,
    /// Earlier tables (offset, bytes), kept because clients may still read them.
    retired_tables: Vec<(u64, u64)>,
    /// How far `fallocate` with `FALLOC_FL_KEEP_SIZE` reserved memory: trimming at close
    /// keeps it, a truncate below it gives it up.
    reserved: u64,
    /// The record-lock table's offset in the primary's region (0: none yet).
    pub record_locks: u64,
}

/// What dropping a dead node's replicas did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Extents (their start on the node, and their tag) of the replicas dropped from stripes
    /// that keep another: the node must free them before it serves again, as they go stale.
    pub extents: Vec<(u64, u64)>,
    /// Extents (base, tag) the pool held on the node ([`crate::pool`]): freed with the
    /// replicas.
    pub pooled: Vec<(u64, u64)>,
    /// Stripes whose only live replica was on the node (they fail until it returns).
    pub lost: u64,
}

impl File {
    /// A new, empty file whose record is at `record` (the caller wrote its other words).
    pub fn new(record: u64, stripe_unit: u64, replicas: u32, region: &Region) -> File {
        write_word(region, record + REC_REPLICAS, replicas as u64);
        File {
            record,
            stripe_unit,
            replicas,
            table: 0,
            table_cap: 0,
            stripes: BTreeMap::new(),
            retired_tables: Vec::new(),
            reserved: 0,
            record_locks: 0,
        }
    }

    /// Sets the replica count of a file that holds no data yet (size 0). Its extent table's
    /// layout depends on the count, so the table is retired and the stripes placed so far
    /// (by its create, for a first write) are freed: a mount writing to them meanwhile finds
    /// them quarantined and writes again to the stripes placed anew.
    pub fn set_replicas(&mut self, replicas: u32, st: &dyn Storage) -> Result<(), Refusal> {
        if !(1..=MAX_REPLICAS).contains(&replicas) {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!("a file has 1 to {MAX_REPLICAS} replicas, not {replicas}"),
            ));
        }
        let (_, region) = st.local();
        if self.table != 0 && st.load(self.record + REC_SIZE) > 0 {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                "a file's replica count is set before its first write (it holds data)",
            ));
        }
        for (k, r) in std::mem::take(&mut self.stripes) {
            self.clear(region, k);
            free_all(&r, st);
        }
        if self.table != 0 {
            self.retired_tables
                .push((self.table, self.table_bytes(self.table_cap)));
            (self.table, self.table_cap) = (0, 0);
            write_word(region, self.record + REC_TABLE, 0);
            write_word(region, self.record + REC_TABLE_CAP, 0);
        }
        write_word(region, self.record + REC_REPLICAS, replicas as u64);
        self.replicas = replicas;
        Ok(())
    }

    /// Node memory the file's replicas hold.
    pub fn memory(&self) -> u64 {
        self.stripes.values().map(Replicas::memory).sum()
    }

    /// Stripes with fewer live replicas off the nodes in `down` than the file asks for.
    pub fn degraded(&self, down: &[u32]) -> u64 {
        self.stripes
            .values()
            .filter(|r| {
                r.live().iter().filter(|e| !down.contains(&e.node)).count() < self.replicas as usize
            })
            .count() as u64
    }

    fn slot(&self, stripe: u64, j: usize) -> u64 {
        entry_offset(self.table, stripe, self.replicas) + j as u64 * ENTRY_LEN
    }

    /// Writes a stripe's table entry, slot by slot: for a replica its location first, then
    /// the tag that makes it live; an empty slot is cleared.
    fn publish(&mut self, region: &Region, stripe: u64, r: Replicas) {
        for (j, s) in r.0.iter().enumerate() {
            match s {
                Some(e) => {
                    let at = self.slot(stripe, j);
                    write_word(region, at, location(e.node, e.offset));
                    write_word(region, at + 8, e.tag);
                }
                None => self.clear_slot(region, stripe, j),
            }
        }
        self.stripes.insert(stripe, r);
    }

    /// Empties slot `j` of a stripe's entry: tag first, then location.
    fn clear_slot(&self, region: &Region, stripe: u64, j: usize) {
        let at = self.slot(stripe, j);
        write_word(region, at + 8, 0);
        write_word(region, at, 0);
    }

    fn clear(&self, region: &Region, stripe: u64) {
        for j in 0..self.replicas as usize {
            self.clear_slot(region, stripe, j);
        }
    }

    /// Marks a stripe's live slots as moving ([`TAG_MOVING`]; locations stay): a mount that
    /// finds them asks the service, which answers once the move is published.
    fn mark_moving(&self, region: &Region, stripe: u64) {
        for (j, s) in self.stripes[&stripe].0.iter().enumerate() {
            if s.is_some() {
                write_word(region, self.slot(stripe, j) + 8, TAG_MOVING);
            }
        }
    }

    /// Stripe `stripe`'s live replicas (none: a hole).
    pub fn stripe(&self, stripe: u64) -> Vec<StripeExtent> {
        self.stripes
            .get(&stripe)
            .map_or_else(Vec::new, Replicas::live)
    }

    /// Up to `max` stripes with fewer live replicas than the file asks for.
    pub fn degraded_stripes(&self, max: usize) -> Vec<u64> {
        self.stripes
            .iter()
            .filter(|(_, r)| r.live().len() < self.replicas as usize)
            .map(|(&k, _)| k)
            .take(max)
            .collect()
    }

    /// Whether stripe `stripe` is below its replicas while one of `nodes` holds a live copy
    /// and another none: a copy could be made if that node had the memory.
    pub fn could_rebuild(&self, stripe: u64, nodes: &[u32]) -> bool {
        let Some(live) = self.stripes.get(&stripe).map(Replicas::live) else {
            return false;
        };
        live.len() < self.replicas as usize
            && live.iter().any(|e| nodes.contains(&e.node))
            && nodes.iter().any(|n| !live.iter().any(|e| e.node == *n))
    }

    /// Copies degraded stripe `stripe` onto another live node, back towards the file's
    /// replication factor. In order: a new extent, tagged with a new tag, is allocated on a
    /// node holding no replica (nothing happens if none can take it); the entry is marked
    /// moving; each surviving replica is retagged in place with the new tag (a mount's write
    /// that found the old tag landed before that, and is in the copy; one that finds the new
    /// tag asks the service, which answers after this); the data is copied from a survivor;
    /// the entry is published with every replica under the new tag. Returns the bytes copied
    /// (0: nothing to do, or no node could take it).
    pub fn rebuild(
        &mut self,
        ino: u64,
        stripe: u64,
        serial: u64,
        st: &dyn Storage,
    ) -> MetaResult<u64> {
        let (_, region) = st.local();
        let Some(old) = self.stripes.get(&stripe).cloned() else {
            return Ok(0);
        };
        let live = old.live();
        let nodes = st.data_nodes();
        let Some(src) = live.iter().find(|e| nodes.contains(&e.node)).copied() else {
            return Ok(0); // no live copy: it waits for a node to return
        };
        if live.len() >= self.replicas as usize {
            return Ok(0);
        }
        // Nodes holding no replica, those of a failure domain no replica is in first.
        let mut candidates: Vec<u32> = nodes
            .iter()
            .copied()
            .filter(|n| !live.iter().any(|e| e.node == *n))
            .collect();
        if candidates.is_empty() {
            return Ok(0);
        }
        // Spread copies over the candidates, a per-file, per-stripe start (the sort is stable).
        let start = ((ino + stripe) % candidates.len() as u64) as usize;
        candidates.rotate_left(start);
        candidates.sort_by_key(|&n| live.iter().any(|e| domain(st, e.node) == domain(st, n)));
        let cap = old.cap();
        let tag = stripe_tag(serial, cap);
        // The new replica's extent first: nothing changes while no node can take it.
        let Some((node, base)) = candidates
            .iter()
            .find_map(|&n| st.alloc(n, cap, Some(tag)).ok().map(|base| (n, base)))
        else {
            return Ok(0);
        };
        self.mark_moving(region, stripe);
        let mut next = old.clone();
        for s in next.0.iter_mut() {
            let Some(e) = *s else { continue };
            match st.retag(e.node, e.offset - TAG_SPACE, e.tag, tag) {
                Ok(()) => *s = Some(StripeExtent { tag, ..e }),
                Err(err) => {
                    tracing::warn!(node = e.node, stripe, error = %err, "a replica could not be retagged for re-replication: dropped");
                    *s = None;
                }
            }
        }
        let copied = match next.0.iter().flatten().find(|e| e.node == src.node) {
            Some(src) => st.copy(src.node, src.offset, tag, node, base + TAG_SPACE, cap),
            None => Err(rackfs_proto::Refusal::new(
                ErrorCode::Unavailable,
                format!("node {} went away", src.node),
            )),
        };
        let copied = match copied {
            Ok(()) => {
                let slot = next
                    .0
                    .iter()
                    .position(Option::is_none)
                    .expect("a free slot");
                next.0[slot] = Some(StripeExtent {
                    node,
                    offset: base + TAG_SPACE,
                    tag,
                });
                cap
            }
            Err(err) => {
                tracing::warn!(src = src.node, dst = node, stripe, error = %err, "copying a stripe for re-replication failed; retrying later");
                let _ = st.free(node, base, Some(tag));
                0
            }
        };
        // Whatever survived is published (the old entry if nothing did).
        let keep = if next.live().is_empty() { old } else { next };
        self.publish(region, stripe, keep);
        Ok(copied)
    }

    /// Makes stripe `stripe` hold at least its first `end` bytes: places a hole's replicas on
    /// different data nodes, or grows its extents. `serial` numbers a new allocation.
    pub fn alloc_stripe(
        &mut self,
        ino: u64,
        stripe: u64,
        end: u64,
        serial: u64,
        st: &dyn Storage,
    ) -> MetaResult<Vec<StripeExtent>> {
        if let Some(r) = self.stripes.get(&stripe) {
            if r.cap() >= end {
                return Ok(r.live());
            }
            let cap = extent_cap(self.stripe_unit, stripe, end, r.cap());
            return self.resize(stripe, cap, serial, st);
        }
        if stripe >= self.table_cap {
            self.grow_table(stripe, st)?;
        }
        let cap = extent_cap(self.stripe_unit, stripe, end, 0);
        let r = self.place(ino, stripe, stripe_tag(serial, cap), None, st)?;
        let (_, region) = st.local();
        let live = r.live();
        self.publish(region, stripe, r);
        Ok(live)
    }

    /// The capacity a hole at stripe `stripe` gets to hold its first `end` bytes; `None` if
    /// the stripe is no hole.
    pub fn hole_cap(&self, stripe: u64, end: u64) -> Option<u64> {
        (!self.stripes.contains_key(&stripe)).then(|| extent_cap(self.stripe_unit, stripe, end, 0))
    }

    /// [`File::alloc_stripe`] for a hole, placed from `slot` ([`crate::pool`]): its serial
    /// numbers the stripe, and its extents are used where the placement puts a replica.
    pub fn alloc_hole_from(
        &mut self,
        ino: u64,
        stripe: u64,
        end: u64,
        slot: Slot,
        st: &dyn Storage,
    ) -> MetaResult<Vec<StripeExtent>> {
        let cap = extent_cap(self.stripe_unit, stripe, end, 0);
        let tag = stripe_tag(slot.serial, cap);
        if self.stripes.contains_key(&stripe) {
            release(slot, tag, st);
            return Err(Refusal::new(
                ErrorCode::Internal,
                "a pooled extent placed where a stripe is",
            ));
        }
        if stripe >= self.table_cap {
            if let Err(e) = self.grow_table(stripe, st) {
                release(slot, tag, st);
                return Err(e);
            }
        }
        let r = self.place(ino, stripe, tag, Some(slot), st)?;
        let (_, region) = st.local();
        let live = r.live();
        self.publish(region, stripe, r);
        Ok(live)
    }

    /// Allocates up to `replicas` extents tagged `tag` on different nodes: round-robin from a
    /// per-file, per-stripe start, so stripes and their copies spread over the nodes, and on
    /// nodes of different failure domains while there are enough ([`Storage::domain`]); a node
    /// that cannot be reached or is full passes its replica on to the next. A stripe gets fewer
    /// replicas (degraded) when fewer nodes can take one, and fails only when none can.
    /// With `slot`, its extents are taken where a replica goes (tagged `tag` already), and
    /// those left over are freed.
    fn place(
        &self,
        ino: u64,
        stripe: u64,
        tag: u64,
        mut slot: Option<Slot>,
        st: &dyn Storage,
    ) -> MetaResult<Replicas> {
        let nodes = st.data_nodes();
        let cap = rackfs_proto::record::tag_capacity(tag);
        let first = ((ino + stripe) % nodes.len() as u64) as usize;
        let order: Vec<u32> = (0..nodes.len())
            .map(|k| nodes[(first + k) % nodes.len()])
            .collect();
        let mut placed: Vec<Option<StripeExtent>> = Vec::new();
        let mut tried = Vec::new();
        let mut last = None;
        // First only nodes of domains not used yet, then any node left.
        for spread in [true, false] {
            for &node in &order {
                if placed.len() == self.replicas as usize {
                    break;
                }
                let shared = placed
                    .iter()
                    .flatten()
                    .any(|e| domain(st, e.node) == domain(st, node));
                if tried.contains(&node) || (spread && shared) {
                    continue;
                }
                tried.push(node);
                let pooled = slot.as_mut().and_then(|s| s.extents.remove(&node));
                match pooled.map_or_else(|| st.alloc(node, cap, Some(tag)), Ok) {
                    Ok(base) => placed.push(Some(StripeExtent {
                        node,
                        offset: base + TAG_SPACE,
                        tag,
                    })),
                    Err(e) if matches!(e.code, ErrorCode::Unavailable | ErrorCode::OutOfMemory) => {
                        last = Some(e)
                    }
                    Err(e) => {
                        for p in placed.iter().flatten() {
                            let _ = st.free(p.node, p.offset - TAG_SPACE, Some(p.tag));
                        }
                        if let Some(s) = slot {
                            release(s, tag, st);
                        }
                        return Err(e);
                    }
                }
            }
        }
        if let Some(s) = slot {
            release(s, tag, st);
        }
        if placed.is_empty() {
            return Err(last.expect("at least one node was tried"));
        }
        if placed.len() < self.replicas as usize {
            // Not a warning per stripe: `rackfs status` counts the degraded files, and the copies
            // are made as soon as a node can take them.
            tracing::debug!(
                ino,
                stripe,
                placed = placed.len(),
                replicas = self.replicas,
                why = %last.as_ref().map_or(String::new(), |e| e.message.clone()),
                "stripe placed with fewer replicas than the file asks for"
            );
        }
        placed.resize(self.replicas as usize, None);
        Ok(Replicas(placed))
    }

    /// A larger table holding stripe `stripe`, filled before the record points at it.
    fn grow_table(&mut self, stripe: u64, st: &dyn Storage) -> MetaResult<()> {
        let (_, region) = st.local();
        let cap = (stripe + 1).next_power_of_two().max(16);
        let table = st.meta_alloc(self.table_bytes(cap))?;
        if self.table != 0 {
            let mut old = vec![0u8; self.table_bytes(self.table_cap) as usize];
            region.read(self.table, &mut old).expect("table in region");
            region.write(table, &old).expect("table in region");
            self.retired_tables
                .push((self.table, self.table_bytes(self.table_cap)));
        }
        self.table = table;
        self.table_cap = cap;
        write_word(region, self.record + REC_TABLE, table);
        write_word(region, self.record + REC_TABLE_CAP, cap);
        Ok(())
    }

    /// The nodes holding a live replica of the stripes in `stripes` (once per replica).
    pub fn replica_nodes(
        &self,
        stripes: impl std::ops::RangeBounds<u64>,
    ) -> impl Iterator<Item = u32> + '_ {
        self.stripes
            .range(stripes)
            .flat_map(|(_, r)| r.0.iter().flatten().map(|e| e.node))
    }

    /// Moves stripe `stripe` into extents of `cap` bytes on the same nodes: the entry is
    /// cleared first (clients that miss it ask the service, which answers after the move),
    /// each data node moves its replica, then the new entry is published. A replica whose move
    /// fails while another's succeeds is dropped (the stripe is left degraded); if every move
    /// fails nothing moved and the old entry is published again.
    fn resize(
        &mut self,
        stripe: u64,
        cap: u64,
        serial: u64,
        st: &dyn Storage,
    ) -> MetaResult<Vec<StripeExtent>> {
        let (_, region) = st.local();
        let old = self.stripes[&stripe].clone();
        self.mark_moving(region, stripe);
        let tag = stripe_tag(serial, cap);
        let mut moved = old.clone();
        let mut failure = None;
        for s in moved.0.iter_mut() {
            let Some(e) = *s else { continue };
            match st.resize(e.node, e.offset - TAG_SPACE, cap, tag, e.tag) {
                Ok(base) => {
                    *s = Some(StripeExtent {
                        node: e.node,
                        offset: base + TAG_SPACE,
                        tag,
                    })
                }
                Err(err) => {
                    tracing::warn!(node = e.node, stripe, error = %err, "a replica could not be moved to a larger extent: dropped");
                    *s = None;
                    failure = Some(err);
                }
            }
        }
        match failure {
            Some(e) if moved.live().is_empty() => {
                self.publish(region, stripe, old);
                Err(e)
            }
            _ => {
                // The old copies are held until the standby has the move (see
                // `crate::history`): a primary that dies first leaves them for the next.
                for (was, now) in old.0.iter().zip(&moved.0) {
                    if let (Some(e), Some(_)) = (was, now) {
                        if let Err(err) = st.free(e.node, e.offset - TAG_SPACE, Some(e.tag)) {
                            tracing::warn!(node = e.node, stripe, error = %err, "a moved stripe's old extent stays allocated");
                        }
                    }
                }
                let live = moved.live();
                self.publish(region, stripe, moved);
                Ok(live)
            }
        }
    }

    /// Shrinks the last stripe's extents to what the file's size needs, when that saves more
    /// than an eighth of them (a file that grew by doubling, or was truncated); frees it if
    /// the file ends before it.
    pub fn trim(&mut self, serial: u64, st: &dyn Storage) -> MetaResult<()> {
        let size = st.load(self.record + REC_SIZE).max(self.reserved);
        let Some((&k, r)) = self.stripes.iter().next_back() else {
            return Ok(());
        };
        if size <= k * self.stripe_unit {
            // None of the file is in it (the stripe an empty file's create placed): free it.
            let r = self.stripes.remove(&k).expect("present");
            self.clear(st.local().1, k);
            free_all(&r, st);
            return Ok(());
        }
        let need = size
            .saturating_sub(k * self.stripe_unit)
            .clamp(1, self.stripe_unit)
            .next_multiple_of(EXTENT_GRANULE);
        if need + r.cap() / 8 >= r.cap() {
            return Ok(());
        }
        self.shrink(k, need, serial, st)
    }

    /// Copies stripe `stripe` into smaller extents of `cap` bytes on the same nodes, publishes
    /// them, then frees the old ones. Unlike [`File::resize`] the old extents stay whole and
    /// live until the new entry is published (no writer can race: the file has no opens), so
    /// a standby that never learns of the shrink (its primary died in it) still finds the
    /// stripe where its layout says; the frees come last, and the daemon holds them back until
    /// the standby has the change. If any copy fails, nothing changes.
    fn shrink(&mut self, stripe: u64, cap: u64, serial: u64, st: &dyn Storage) -> MetaResult<()> {
        let (_, region) = st.local();
        let old = self.stripes[&stripe].clone();
        let tag = stripe_tag(serial, cap);
        let mut new = old.clone();
        let mut made = Vec::new();
        let mut failure = None;
        for s in new.0.iter_mut() {
            let Some(e) = *s else { continue };
            let copied = st.alloc(e.node, cap, Some(tag)).and_then(|base| {
                made.push((e.node, base));
                st.copy(e.node, e.offset, e.tag, e.node, base + TAG_SPACE, cap)?;
                Ok(base)
            });
            match copied {
                Ok(base) => {
                    *s = Some(StripeExtent {
                        node: e.node,
                        offset: base + TAG_SPACE,
                        tag,
                    })
                }
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        if let Some(err) = failure {
            for (node, base) in made {
                let _ = st.free(node, base, Some(tag));
            }
            return Err(err);
        }
        self.publish(region, stripe, new);
        free_all(&old, st);
        Ok(())
    }

    /// After the size became `size` (from `old`): zeroes the cut-off tail of the last kept
    /// stripe (so a later extension reads zeros) and frees the stripes wholly beyond it, even
    /// when the file grew (a stripe allocated past the end by a write that never set the size
    /// would otherwise stay until unlink). A replica that cannot be zeroed is dropped while
    /// another is; its node's memory is freed when it can be.
    pub fn cut(&mut self, size: u64, old: u64, st: &dyn Storage) -> MetaResult<()> {
        let (_, region) = st.local();
        let unit = self.stripe_unit;
        self.reserved = self.reserved.min(size);
        if size < old && !size.is_multiple_of(unit) {
            self.zero_in(size / unit, size % unit, unit, st)?;
        }
        let gone: Vec<u64> = self
            .stripes
            .range(size.div_ceil(unit)..)
            .map(|(&k, _)| k)
            .collect();
        for k in gone {
            let r = self.stripes.remove(&k).expect("present");
            self.clear(region, k);
            free_all(&r, st);
        }
        Ok(())
    }

    /// Zeroes bytes `[from, to)` of stripe `stripe` where its extents hold them (beyond an
    /// extent's capacity the stripe reads zeros already). A replica that cannot be zeroed is
    /// dropped while another is; its node's memory is freed when it can be.
    fn zero_in(&mut self, stripe: u64, from: u64, to: u64, st: &dyn Storage) -> MetaResult<()> {
        let Some(r) = self.stripes.get(&stripe).cloned() else {
            return Ok(());
        };
        let to = to.min(r.cap());
        if from >= to {
            return Ok(());
        }
        let mut zeroed = r.clone();
        let mut failure = None;
        for (j, s) in r.0.iter().enumerate() {
            let Some(e) = s else { continue };
            if let Err(err) = st.zero(e.node, e.offset + from, to - from, e.tag) {
                failure = Some(err);
                zeroed.0[j] = None;
            }
        }
        let Some(e) = failure else { return Ok(()) };
        if zeroed.live().is_empty() {
            return Err(e);
        }
        let (_, region) = st.local();
        for j in 0..r.0.len() {
            if zeroed.0[j].is_none() && r.0[j].is_some() {
                self.clear_slot(region, stripe, j);
            }
        }
        self.stripes.insert(stripe, zeroed);
        Ok(())
    }

    /// The stripes bytes `[from, to)` touch: (stripe, first byte in it, end in it).
    fn span(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64, u64)> {
        let unit = self.stripe_unit;
        (from / unit..to.div_ceil(unit)).map(move |k| {
            let base = k * unit;
            (k, from.max(base) - base, to.min(base + unit) - base)
        })
    }

    /// Allocates every stripe bytes `[from, to)` touch, as writes there would (`fallocate`
    /// mode 0); `serial` numbers each new allocation. `keep_size`: the memory stays reserved
    /// past the end of file (trimming at close keeps it).
    pub fn reserve(
        &mut self,
        ino: u64,
        from: u64,
        to: u64,
        keep_size: bool,
        serial: &mut u64,
        st: &dyn Storage,
    ) -> MetaResult<()> {
        for (k, _, end) in self.span(from, to).collect::<Vec<_>>() {
            let this = *serial;
            *serial += 1;
            self.alloc_stripe(ino, k, end, this, st)?;
            if keep_size {
                self.reserved = self.reserved.max(k * self.stripe_unit + end);
            }
        }
        Ok(())
    }

    /// Frees the stripes wholly inside bytes `[from, to)` (their memory goes back to the
    /// nodes) and zeroes the rest of the range (`FALLOC_FL_PUNCH_HOLE`).
    pub fn punch(&mut self, from: u64, to: u64, st: &dyn Storage) -> MetaResult<()> {
        let (_, region) = st.local();
        for (k, a, b) in self.span(from, to).collect::<Vec<_>>() {
            if a == 0 && b == self.stripe_unit {
                if let Some(r) = self.stripes.remove(&k) {
                    self.clear(region, k);
                    free_all(&r, st);
                }
            } else {
                self.zero_in(k, a, b, st)?;
            }
        }
        Ok(())
    }

    /// Zeroes bytes `[from, to)` where they are allocated (`FALLOC_FL_ZERO_RANGE`, after
    /// [`File::reserve`]).
    pub fn zero(&mut self, from: u64, to: u64, st: &dyn Storage) -> MetaResult<()> {
        for (k, a, b) in self.span(from, to).collect::<Vec<_>>() {
            self.zero_in(k, a, b, st)?;
        }
        Ok(())
    }

    /// Drops `node`'s replicas from every stripe that has another live one (adding them to
    /// `d`).
    pub fn drop_node(&mut self, node: u32, region: &Region, d: &mut Dropped) {
        let mut changed = Vec::new();
        for (&k, r) in &self.stripes {
            let Some(j) = r.on(node) else { continue };
            if r.live().len() > 1 {
                changed.push((k, j));
                let e = r.0[j].expect("live slot");
                d.extents.push((e.offset - TAG_SPACE, e.tag));
            } else {
                d.lost += 1;
            }
        }
        for (k, j) in changed {
            self.clear_slot(region, k, j);
            if let Some(r) = self.stripes.get_mut(&k) {
                r.0[j] = None;
            }
        }
    }

    /// The replicas the file lists on `node`: (stripe, slot, extent).
    pub fn replicas_on(&self, node: u32) -> Vec<(u64, usize, StripeExtent)> {
        self.stripes
            .iter()
            .filter_map(|(&k, r)| r.on(node).map(|j| (k, j, r.0[j].expect("live slot"))))
            .collect()
    }

    /// Points slot `j` of stripe `k` at where its node holds the data now (`Some`: base
    /// offset and tag), or drops it (`None`) unless it is the stripe's last replica (which
    /// then fails its reads, as a lost stripe should, instead of reading as a hole). Returns
    /// whether the slot changed.
    pub fn relocate(&mut self, region: &Region, k: u64, j: usize, now: Option<(u64, u64)>) -> bool {
        let Some(mut r) = self.stripes.get(&k).cloned() else {
            return false;
        };
        let Some(e) = r.0[j] else { return false };
        match now {
            Some((base, tag)) => {
                r.0[j] = Some(StripeExtent {
                    offset: base + TAG_SPACE,
                    tag,
                    ..e
                })
            }
            None if r.live().len() > 1 => r.0[j] = None,
            None => return false,
        }
        self.publish(region, k, r);
        true
    }

    /// Every replica of a stripe carries one tag. When the old primary moved or retagged only
    /// some of a stripe's replicas before it died, and every node holding one has been asked
    /// (`resolved`), the replicas with the latest tag hold all the others held: the others
    /// are dropped and returned in `stale` for freeing.
    pub fn settle_tags(
        &mut self,
        region: &Region,
        resolved: &BTreeSet<u32>,
        stale: &mut Vec<StripeExtent>,
    ) {
        let mixed: Vec<u64> = self
            .stripes
            .iter()
            .filter(|(_, r)| {
                let live = r.live();
                live.iter().any(|e| e.tag != live[0].tag)
                    && live.iter().all(|e| resolved.contains(&e.node))
            })
            .map(|(&k, _)| k)
            .collect();
        for k in mixed {
            let mut r = self.stripes[&k].clone();
            let latest = r
                .live()
                .iter()
                .map(|e| tag_serial(e.tag))
                .max()
                .unwrap_or(0);
            for s in r.0.iter_mut() {
                if let Some(e) = s.filter(|e| tag_serial(e.tag) != latest) {
                    stale.push(e);
                    *s = None;
                }
            }
            self.publish(region, k, r);
        }
    }

    /// Stripes whose only live replica is on a node in `down`.
    pub fn lost(&self, down: &[u32]) -> u64 {
        self.stripes
            .values()
            .filter(|r| r.live().iter().all(|e| down.contains(&e.node)))
            .count() as u64
    }

    /// Frees everything the file holds: its stripes' extents, its tables and its record.
    pub fn delete(self, st: &dyn Storage) {
        for r in self.stripes.values() {
            free_all(r, st);
        }
        for (at, len) in self.meta_extents() {
            st.meta_free(at, len);
        }
    }

    /// The extents of the metadata area the file holds: (offset, bytes) of its record and
    /// every table, retired ones included.
    pub fn meta_extents(&self) -> Vec<(u64, u64)> {
        let mut v = vec![(self.record, RECORD_LEN)];
        v.extend(&self.retired_tables);
        if self.table != 0 {
            v.push((self.table, self.table_bytes(self.table_cap)));
        }
        if self.record_locks != 0 {
            v.push((self.record_locks, rackfs_locks::record::TABLE_LEN));
        }
        v
    }

    fn table_bytes(&self, entries: u64) -> u64 {
        entry_offset(0, entries, self.replicas)
    }
}

/// Node `node`'s failure domain for placement (a node without one is a domain of its own).
fn domain(st: &dyn Storage, node: u32) -> String {
    st.domain(node).unwrap_or_else(|| format!("\0node {node}"))
}

/// Frees every live replica's extent; a node that cannot be reached keeps its (unreferenced)
/// extent, logged.
fn free_all(r: &Replicas, st: &dyn Storage) {
    for e in r.0.iter().flatten() {
        if let Err(err) = st.free(e.node, e.offset - TAG_SPACE, Some(e.tag)) {
            tracing::warn!(node = e.node, error = %err, "a freed stripe's extent stays allocated on its node");
        }
    }
}

/// The capacity of a new extent for stripe `stripe` that must hold `end` bytes, replacing one
/// of `old` bytes (0: none). The first stripe grows geometrically (so a file written in
/// pieces is copied O(1) times per byte) up to the whole stripe; later stripes are whole.
pub fn extent_cap(unit: u64, stripe: u64, end: u64, old: u64) -> u64 {
    if stripe > 0 {
        return unit;
    }
    let want = end
        .max(old.saturating_mul(2))
        .max(1)
        .next_multiple_of(EXTENT_GRANULE);
    if want >= unit - unit / 4 {
        unit
    } else {
        want
    }
}

/// Frees the extents of a pooled slot that no replica took (tagged `tag`).
fn release(slot: Slot, tag: u64, st: &dyn Storage) {
    for (node, base) in slot.extents {
        if let Err(e) = st.free(node, base, Some(tag)) {
            tracing::warn!(node, base, error = %e, "a pooled extent stays allocated");
        }
    }
}

/// Reads a word of the service's own region (atomically: clients CAS the same words).
pub fn read_word(region: &Region, offset: u64) -> u64 {
    region.load(offset).expect("word in region")
}

/// Writes a word of the service's own region (atomically).
pub fn write_word(region: &Region, offset: u64, v: u64) {
    region.store(offset, v).expect("word in region")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    /// The live slots of stripe `k`'s entry as the table holds them: (node, tag).
    fn entry(st: &MemStorage, f: &File, k: u64) -> Vec<(u32, u64)> {
        let (_, region) = st.local();
        (0..f.replicas as usize)
            .map(|j| {
                let at = f.slot(k, j);
                (read_word(region, at), read_word(region, at + 8))
            })
            .filter(|&(loc, tag)| loc != 0 && tag != 0)
            .map(|(loc, tag)| (rackfs_proto::record::split_location(loc).0, tag))
            .collect()
    }

    fn file(st: &MemStorage, replicas: u32, stripes: u64) -> File {
        let (me, region) = st.local();
        let record = st.alloc(me, 64, None).unwrap();
        let mut f = File::new(record, 4096, replicas, region);
        for k in 0..stripes {
            f.alloc_stripe(7, k, 4096, k + 1, st).unwrap();
        }
        f
    }

    #[test]
    fn replicas_sit_on_distinct_nodes_and_the_table_lists_each() {
        let st = MemStorage::new(3, 1 << 24);
        let f = file(&st, 2, 9);
        for k in 0..9 {
            let e = entry(&st, &f, k);
            assert_eq!(e.len(), 2, "stripe {k}: {e:?}");
            assert_ne!(e[0].0, e[1].0, "stripe {k} has both replicas on one node");
            assert_eq!(e[0].1, e[1].1, "one tag per stripe");
        }
    }

    #[test]
    fn replicas_go_to_different_failure_domains_while_there_are_enough() {
        let st = MemStorage::new(4, 1 << 24);
        for (node, rack) in [(0, "a"), (1, "a"), (2, "b"), (3, "b")] {
            st.set_domain(node, rack);
        }
        let f = file(&st, 2, 16);
        let rack = |n: u32| if n < 2 { "a" } else { "b" };
        for k in 0..16 {
            let e = entry(&st, &f, k);
            assert_ne!(rack(e[0].0), rack(e[1].0), "stripe {k} in one rack: {e:?}");
        }
        // Three replicas over two racks: the third shares a rack, on a node of its own.
        let f = file(&st, 3, 4);
        for k in 0..4 {
            let mut nodes: Vec<u32> = entry(&st, &f, k).iter().map(|e| e.0).collect();
            nodes.sort_unstable();
            nodes.dedup();
            assert_eq!(nodes.len(), 3, "stripe {k}");
        }
    }

    #[test]
    fn a_dead_node_is_dropped_where_another_replica_lives_and_copies_restore_the_factor() {
        let st = MemStorage::new(3, 1 << 24);
        let mut two = file(&st, 2, 9);
        let mut one = file(&st, 1, 9);
        let on1 = |f: &File| {
            (0..9)
                .filter(|&k| entry(&st, f, k).iter().any(|e| e.0 == 1))
                .count()
        };
        let (had2, had1) = (on1(&two), on1(&one));
        assert!(had2 > 0 && had1 > 0, "node 1 holds some of each");
        st.set_down(1);
        let (_, region) = st.local();
        let mut d = Dropped::default();
        two.drop_node(1, region, &mut d);
        one.drop_node(1, region, &mut d);
        // Dropped where a copy is left; a stripe's only copy stays (it fails, not a hole).
        assert_eq!((d.extents.len(), d.lost as usize), (had2, had1));
        assert_eq!((on1(&two), on1(&one)), (0, had1));
        assert_eq!(two.degraded(&[]), had2 as u64);
        assert_eq!(one.lost(&[1]), had1 as u64);
        for (n, k) in two.degraded_stripes(100).into_iter().enumerate() {
            let old = entry(&st, &two, k)[0].1;
            assert_eq!(two.rebuild(7, k, 100 + n as u64, &st).unwrap(), 4096);
            let e = entry(&st, &two, k);
            assert_eq!(e.len(), 2, "stripe {k} copied back: {e:?}");
            assert!(
                e.iter().all(|x| x.0 != 1 && x.1 != old),
                "new tag, live nodes: {e:?}"
            );
        }
        assert_eq!(two.degraded(&[]), 0);
        // Nothing to copy where a single node is left.
        st.set_down(2);
        let mut d = Dropped::default();
        two.drop_node(2, region, &mut d);
        for k in two.degraded_stripes(100) {
            assert_eq!(two.rebuild(7, k, 999, &st).unwrap(), 0);
            assert_eq!(entry(&st, &two, k).len(), 1, "the survivor stays published");
        }
    }
}
