//! The extent allocator of a memory node's region.
//!
//! Best fit over a free list kept twice — by offset (to coalesce neighbours on free) and by
//! (size, offset) (to find the smallest extent that fits) — so freed space is reused, adjacent
//! free extents always merge, and large requests are not starved by small ones scattered through
//! the region. Sizes are rounded up to a 64-byte granule (a cache line, and 8-byte aligned for
//! atomics); alignment may be any larger power of two.

use std::collections::{BTreeMap, BTreeSet};

use rackfs_proto::size::format_size;

/// Allocation granule in bytes.
pub const GRANULE: u64 = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("out of memory on node {node}: requested {}, largest free extent {}, {} free of {}",
        format_size(*requested), format_size(*largest_free), format_size(*free), format_size(*capacity))]
    OutOfMemory {
        node: String,
        requested: u64,
        largest_free: u64,
        free: u64,
        capacity: u64,
    },
    #[error("invalid allocation: {0}")]
    Invalid(String),
    #[error("offset {offset:#x} is not the start of an allocated extent")]
    NotAllocated { offset: u64 },
}

/// Usage figures of an allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocStats {
    pub capacity: u64,
    pub used: u64,
    pub free: u64,
    pub largest_free: u64,
    pub extents: u64,
    pub free_extents: u64,
}

/// What an allocated extent holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// A lock tree, a QoS area: freed and reusable at once.
    Plain,
    /// A file stripe, its owner tag in its first word.
    Stripe,
    /// A freed file stripe held back from reuse until its quarantine ends (freeing it again
    /// changes nothing: only the quarantine's end frees it).
    Quarantined,
}

pub struct ExtentAllocator {
    node: String,
    capacity: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    /// Allocated extents: offset -> (length, what it holds).
    allocated: BTreeMap<u64, (u64, Use)>,
    used: u64,
}

impl ExtentAllocator {
    /// Manages `[base, base + len)` (both rounded inward to the granule).
    pub fn new(node: &str, base: u64, len: u64) -> Self {
        let start = base.next_multiple_of(GRANULE);
        let end = (base + len) / GRANULE * GRANULE;
        let mut a = ExtentAllocator {
            node: node.into(),
            capacity: end.saturating_sub(start),
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            allocated: BTreeMap::new(),
            used: 0,
        };
        if end > start {
            a.insert_free(start, end - start);
        }
        a
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.by_offset.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.by_offset.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// Allocates `len` bytes aligned to `align` (a power of two; at least the granule).
    pub fn alloc(&mut self, len: u64, align: u64) -> Result<u64, AllocError> {
        self.alloc_as(len, align, Use::Plain)
    }

    /// [`ExtentAllocator::alloc`], remembering what the extent holds.
    pub fn alloc_as(&mut self, len: u64, align: u64, use_: Use) -> Result<u64, AllocError> {
        if len == 0 {
            return Err(AllocError::Invalid("zero-length extent".into()));
        }
        if !align.is_power_of_two() {
            return Err(AllocError::Invalid(format!(
                "alignment {align} is not a power of two"
            )));
        }
        let align = align.max(GRANULE);
        let len = len
            .checked_next_multiple_of(GRANULE)
            .ok_or_else(|| AllocError::Invalid(format!("length {len} overflows")))?;
        let found = self.by_size.range((len, 0)..).find_map(|&(size, off)| {
            let start = off.checked_next_multiple_of(align)?;
            (start + len <= off + size).then_some((size, off, start))
        });
        let Some((size, off, start)) = found else {
            let s = self.stats();
            return Err(AllocError::OutOfMemory {
                node: self.node.clone(),
                requested: len,
                largest_free: s.largest_free,
                free: s.free,
                capacity: s.capacity,
            });
        };
        self.remove_free(off, size);
        if start > off {
            self.insert_free(off, start - off);
        }
        let tail = off + size - (start + len);
        if tail > 0 {
            self.insert_free(start + len, tail);
        }
        self.allocated.insert(start, (len, use_));
        self.used += len;
        Ok(start)
    }

    /// Allocates exactly `[offset, offset + len)` (rounded out to the granule), which must be
    /// free: a standby taking over marks what its replayed namespace holds.
    pub fn reserve(&mut self, offset: u64, len: u64) -> Result<(), AllocError> {
        let end = (offset + len).next_multiple_of(GRANULE);
        let start = offset / GRANULE * GRANULE;
        let Some((&off, &size)) = self.by_offset.range(..=start).next_back() else {
            return Err(AllocError::Invalid(format!("{start:#x} is not free")));
        };
        if off + size < end {
            return Err(AllocError::Invalid(format!(
                "[{start:#x}, {end:#x}) is not free"
            )));
        }
        self.remove_free(off, size);
        if start > off {
            self.insert_free(off, start - off);
        }
        if off + size > end {
            self.insert_free(end, off + size - end);
        }
        self.allocated.insert(start, (end - start, Use::Plain));
        self.used += end - start;
        Ok(())
    }

    /// Frees the extent starting at `offset`; returns its length.
    pub fn free(&mut self, offset: u64) -> Result<u64, AllocError> {
        let (len, _) = self
            .allocated
            .remove(&offset)
            .ok_or(AllocError::NotAllocated { offset })?;
        self.used -= len;
        let (mut start, mut size) = (offset, len);
        if let Some((&prev, &plen)) = self.by_offset.range(..offset).next_back() {
            if prev + plen == offset {
                self.remove_free(prev, plen);
                start = prev;
                size += plen;
            }
        }
        if let Some(&nlen) = self.by_offset.get(&(offset + len)) {
            self.remove_free(offset + len, nlen);
            size += nlen;
        }
        self.insert_free(start, size);
        Ok(len)
    }

    /// Length and use of the allocated extent at `offset`, if there is one.
    pub fn extent(&self, offset: u64) -> Option<(u64, Use)> {
        self.allocated.get(&offset).copied()
    }

    /// Marks an extent as no longer a live file stripe (freed into quarantine).
    pub fn mark_quarantined(&mut self, offset: u64) {
        if let Some(e) = self.allocated.get_mut(&offset) {
            e.1 = Use::Quarantined;
        }
    }

    /// The allocated extent that contains `[offset, offset + len)`, if one does.
    pub fn containing(&self, offset: u64, len: u64) -> Option<u64> {
        let (&start, &(elen, _)) = self.allocated.range(..=offset).next_back()?;
        (offset + len <= start + elen).then_some(start)
    }

    pub fn stats(&self) -> AllocStats {
        AllocStats {
            capacity: self.capacity,
            used: self.used,
            free: self.capacity - self.used,
            largest_free: self.by_size.last().map_or(0, |&(s, _)| s),
            extents: self.allocated.len() as u64,
            free_extents: self.by_offset.len() as u64,
        }
    }

    /// Checks every internal invariant (for tests): the free and allocated extents tile the
    /// managed range without overlap, and no two free extents touch.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut all: Vec<(u64, u64, bool)> =
            self.by_offset.iter().map(|(&o, &l)| (o, l, true)).collect();
        all.extend(self.allocated.iter().map(|(&o, &(l, _))| (o, l, false)));
        all.sort();
        let mut covered = 0;
        for w in all.windows(2) {
            let ((a, al, af), (b, _, bf)) = (w[0], w[1]);
            if a + al > b {
                return Err(format!("extents at {a:#x} and {b:#x} overlap"));
            }
            if af && bf && a + al == b {
                return Err(format!("free extents at {a:#x} and {b:#x} were not merged"));
            }
        }
        for &(_, l, _) in &all {
            covered += l;
        }
        if covered != self.capacity || self.by_size.len() != self.by_offset.len() {
            return Err(format!(
                "extents cover {covered} of {} bytes",
                self.capacity
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reuse_and_oom_message() {
        let mut a = ExtentAllocator::new("mn0", 0, 1 << 20);
        let x = a.alloc(4096, 4096).unwrap();
        let y = a.alloc(1000, 64).unwrap();
        assert_eq!(a.free(x).unwrap(), 4096);
        assert_eq!(a.alloc(4096, 4096).unwrap(), x, "freed space is reused");
        assert!(matches!(
            a.free(y + 64),
            Err(AllocError::NotAllocated { .. })
        ));
        let err = a.alloc(2 << 20, 64).unwrap_err().to_string();
        assert!(
            err.starts_with("out of memory on node mn0: requested 2.00 MiB, largest free extent"),
            "{err}"
        );
        a.free(x).unwrap();
        a.free(y).unwrap();
        assert_eq!(a.stats().largest_free, 1 << 20, "everything coalesces back");
    }

    proptest! {
        #[test]
        fn random_alloc_free_keeps_invariants(ops in proptest::collection::vec((any::<bool>(), 1u64..50_000, 0u32..14, any::<u16>()), 1..300)) {
            let mut a = ExtentAllocator::new("mn", 128, 4 << 20);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (is_alloc, len, align_log, pick) in ops {
                if is_alloc || live.is_empty() {
                    let align = 1u64 << align_log;
                    if let Ok(off) = a.alloc(len, align) {
                        prop_assert_eq!(off % align.max(GRANULE), 0);
                        live.push((off, len.next_multiple_of(GRANULE)));
                    }
                } else {
                    let (off, len) = live.swap_remove(pick as usize % live.len());
                    prop_assert_eq!(a.free(off).unwrap(), len);
                }
                a.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert_eq!(a.stats().used, live.iter().map(|e| e.1).sum::<u64>());
            }
            for (off, _) in live { a.free(off).unwrap(); }
            prop_assert_eq!(a.stats().free_extents, 1);
            prop_assert_eq!(a.stats().largest_free, a.stats().capacity);
        }
    }
}
