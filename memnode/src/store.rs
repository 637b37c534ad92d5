//! The node's memory: its data region, the extent allocator over it, and the quarantine that
//! holds freed file stripes back from reuse.
//!
//! Remote memory ownership: the store writes region memory only to write a stripe's owner tag
//! when it hands the stripe out, to tombstone it (0) when it is freed or moved, to copy a
//! moved stripe's data into its new extent, and to zero extents (freed ones, and `Zero`
//! requests for truncate); everything else is written by clients through verbs into extents
//! the allocator handed out (see `rackfs_proto::record`).
//!
//! An allocation that fails only because freed memory is still in quarantine waits for the
//! quarantine (at most its hold time) instead of failing with ENOSPC.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::{Mutex, SharedClock};
use rackfs_proto::control::{ErrorCode, NodeStats};
use rackfs_proto::record::TAG_SPACE;
use rackfs_proto::Refusal;
use rackfs_verbs::Region;
use tracing::warn;

use rackfs_meta::history::TagHistory;
use rackfs_proto::control::Resolved;

use crate::alloc::{AllocError, ExtentAllocator, Use};

/// Tagged extents freed and not yet reusable: (reusable at, on the node's clock; offset;
/// length).
type Quarantine = Vec<(Duration, u64, u64)>;

/// Where the metadata area starts (offset 0 of a region is never a record).
const META_BASE: u64 = 4096;

/// The metadata area of a cluster member's region of `len` bytes: a sixteenth of it, at the
/// same offsets on every node so that a standby mirrors the primary's records and tables.
pub fn meta_area_len(len: u64) -> u64 {
    (len / 16).next_multiple_of(4096).max(2 * META_BASE)
}

/// The data region with its allocators and quarantine.
pub struct Store {
    region: Arc<Region>,
    /// File stripes, lock trees and the QoS area: the region past the metadata area.
    allocator: Mutex<ExtentAllocator>,
    /// Records and extent tables: `[META_BASE, meta_len)`, used on the primary only.
    meta: Mutex<ExtentAllocator>,
    meta_len: u64,
    quarantine: Mutex<Quarantine>,
    hold: Duration,
    /// The node's clock: the quarantine's time.
    clock: SharedClock,
    /// Moves and retags of stripe extents, for a primary that takes over (taken after
    /// `allocator`, never before it).
    history: Mutex<TagHistory>,
}

impl From<AllocError> for Refusal {
    fn from(e: AllocError) -> Refusal {
        let code = match e {
            AllocError::OutOfMemory { .. } => ErrorCode::OutOfMemory,
            AllocError::Invalid(_) => ErrorCode::Invalid,
            AllocError::NotAllocated { .. } => ErrorCode::NotFound,
        };
        Refusal::new(code, e.to_string())
    }
}

impl Store {
    /// A store over `region` whose first `meta_len` bytes are the metadata area (0: none);
    /// freed stripes are held back for `hold` on `clock`.
    pub fn new(
        name: &str,
        region: Arc<Region>,
        hold: Duration,
        meta_len: u64,
        clock: SharedClock,
    ) -> Store {
        let len = region.info().len;
        Store {
            region,
            allocator: Mutex::new(ExtentAllocator::new(name, meta_len, len - meta_len)),
            meta: Mutex::new(Self::meta_allocator(name, meta_len)),
            meta_len,
            quarantine: Mutex::new(Vec::new()),
            hold,
            clock,
            history: Mutex::default(),
        }
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    fn meta_allocator(name: &str, meta_len: u64) -> ExtentAllocator {
        ExtentAllocator::new(name, META_BASE, meta_len.saturating_sub(META_BASE))
    }

    /// How long the metadata area is.
    pub fn meta_len(&self) -> u64 {
        self.meta_len
    }

    /// Allocates `len` bytes of the metadata area.
    pub fn meta_alloc(&self, len: u64) -> Result<u64, AllocError> {
        self.meta
            .lock()
            .expect("meta allocator lock")
            .alloc(len, 64)
    }

    /// Frees and zeroes a metadata-area extent.
    pub fn meta_free(&self, offset: u64) {
        let mut a = self.meta.lock().expect("meta allocator lock");
        if let Some((len, _)) = a.extent(offset) {
            self.region
                .discard(offset, len)
                .expect("extent inside the region");
            let _ = a.free(offset);
        }
    }

    /// Starts the metadata allocator afresh with `held` (offset, bytes) allocated: a standby
    /// taking over with the namespace it replayed. Everything else in the area is zeroed: the
    /// mirror left the bytes of records and tables its primary freed since (an extent table
    /// replaced as its file grew), and a new extent must come zeroed (a lock tree whose words
    /// are not is held by nobody, for ever).
    pub fn meta_adopt(&self, name: &str, held: &[(u64, u64)]) -> Result<(), AllocError> {
        let mut a = Self::meta_allocator(name, self.meta_len);
        for &(at, len) in held {
            a.reserve(at, len)?;
        }
        let mut held = held.to_vec();
        held.sort_unstable();
        let mut from = META_BASE;
        for (at, len) in held.into_iter().chain([(self.meta_len, 0)]) {
            if at > from {
                self.region
                    .discard(from, at - from)
                    .expect("metadata area inside the region");
            }
            from = from.max(at + len);
        }
        *self.meta.lock().expect("meta allocator lock") = a;
        Ok(())
    }

    /// Allocates an extent; a tagged one (a file stripe) gets [`TAG_SPACE`] in front of its
    /// data and its tag written before it is handed out.
    pub fn alloc(&self, len: u64, align: u64, tag: Option<u64>) -> Result<u64, AllocError> {
        let (len, use_) = match tag {
            Some(_) => (
                len.checked_add(TAG_SPACE)
                    .ok_or_else(|| AllocError::Invalid("length overflows".into()))?,
                Use::Stripe,
            ),
            None => (len, Use::Plain),
        };
        let offset = self.alloc_waiting(len, align, use_)?;
        if let Some(t) = tag {
            self.region.store(offset, t).expect("tag inside the region");
        }
        Ok(offset)
    }

    /// Allocates one file stripe extent of `len` data bytes per tag of `tags` (as
    /// [`Store::alloc`] with that tag), but only from memory free now: extents placed ahead of
    /// need ([`ControlRequest::AllocMany`](rackfs_proto::ControlRequest::AllocMany)) never wait
    /// for quarantined memory, which the stripes that need it wait for. Returns the base
    /// offsets of as many as fit, in order; fails only if none does.
    pub fn alloc_many(&self, len: u64, align: u64, tags: &[u64]) -> Result<Vec<u64>, AllocError> {
        let len = len
            .checked_add(TAG_SPACE)
            .ok_or_else(|| AllocError::Invalid("length overflows".into()))?;
        let mut out = Vec::with_capacity(tags.len());
        for &tag in tags {
            let got =
                self.allocator
                    .lock()
                    .expect("allocator lock")
                    .alloc_as(len, align, Use::Stripe);
            match got {
                Ok(offset) => {
                    self.region
                        .store(offset, tag)
                        .expect("tag inside the region");
                    out.push(offset);
                }
                Err(e) if out.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// Allocates, and while the region is full but quarantined extents may make room, waits
    /// for them to come back (the quarantine's hold at most).
    fn alloc_waiting(&self, len: u64, align: u64, use_: Use) -> Result<u64, AllocError> {
        loop {
            let res = self
                .allocator
                .lock()
                .expect("allocator lock")
                .alloc_as(len, align, use_);
            let Err(AllocError::OutOfMemory { .. }) = res else {
                return res;
            };
            let next = self
                .quarantine
                .lock()
                .expect("quarantine lock")
                .iter()
                .map(|q| q.0)
                .min();
            let Some(due) = next else {
                return res;
            };
            self.clock.sleep(due.saturating_sub(self.clock.now()));
            self.reap();
        }
    }

    /// Moves the file stripe extent at `offset` into a new one holding `len` data bytes and
    /// tagged `tag`: tombstones the old tag and copies what fits (see `rackfs_proto::record`
    /// for why this order loses no client write). The old extent stays held until the primary
    /// frees it, once its standby has the move (see [`rackfs_meta::history`]). Returns the new
    /// extent's offset.
    pub fn resize(&self, offset: u64, len: u64, tag: u64, expect: u64) -> Result<u64, Refusal> {
        let old_len = {
            let a = self.allocator.lock().expect("allocator lock");
            self.owned(&a, offset, expect)?
        };
        let new = self.alloc(len, 1, Some(tag))?;
        self.region.store(offset, 0).expect("tag inside the region");
        // A client's write that found the tag live was ordered before this point.
        fence(Ordering::SeqCst);
        self.region
            .copy_within(
                offset + TAG_SPACE,
                new + TAG_SPACE,
                (old_len - TAG_SPACE).min(len),
            )
            .expect("both extents inside the region");
        self.history
            .lock()
            .expect("history lock")
            .moved(offset, expect, new, tag);
        Ok(new)
    }

    /// Refuses unless the extent at `base` is a live stripe extent tagged `tag` (the service
    /// names the tag it expects on every change to a stripe: see
    /// `rackfs_proto::control::ControlRequest::Retag`); returns its length.
    fn owned(&self, a: &ExtentAllocator, base: u64, tag: u64) -> Result<u64, Refusal> {
        let found = match a.extent(base) {
            Some((len, Use::Stripe)) => {
                (len, self.region.load(base).expect("tag inside the region"))
            }
            _ => (0, 0),
        };
        if found.1 != tag || found.0 == 0 {
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!(
                    "no stripe extent tagged {tag:#x} at {base:#x} (found tag {:#x})",
                    found.1
                ),
            ));
        }
        Ok(found.0)
    }

    /// Frees an extent (with `tag`, only the stripe extent tagged so, or moved away with that
    /// tag): plain extents are zeroed and reusable at once; tagged ones are tombstoned and
    /// quarantined first. Returns the extent's length.
    pub fn free(&self, offset: u64, tag: Option<u64>) -> Result<u64, Refusal> {
        let mut a = self.allocator.lock().expect("allocator lock");
        if let Some(t) = tag {
            let moved = self
                .history
                .lock()
                .expect("history lock")
                .moved_from(offset, t);
            if !moved {
                self.owned(&a, offset, t)?;
            }
        }
        let (len, use_) = a
            .extent(offset)
            .ok_or(AllocError::NotAllocated { offset })?;
        match use_ {
            Use::Stripe => {
                // Tombstoned and marked in one hold of the allocator, so a free racing this
                // one finds it quarantined.
                self.region.store(offset, 0).expect("tag inside the region");
                a.mark_quarantined(offset);
                self.history.lock().expect("history lock").forget(offset);
                drop(a);
                let until = self.clock.now() + self.hold;
                let mut q = self.quarantine.lock().expect("quarantine lock");
                q.push((until, offset, len));
                Ok(len)
            }
            // Freed already (a free sent again: one that timed out while the node was
            // stopped, and ran when it resumed): only the quarantine's end frees it, or the
            // memory would be handed out while the quarantine still holds it.
            Use::Quarantined => {
                tracing::debug!(
                    offset,
                    "an extent in quarantine is freed again: nothing to do"
                );
                Ok(len)
            }
            Use::Plain => {
                self.region
                    .discard(offset, len)
                    .expect("extent inside the region");
                Ok(a.free(offset)?)
            }
        }
    }

    /// Gives the live stripe extent at `offset`, tagged `expect`, the tag `tag`, in place
    /// (re-replication).
    pub fn retag(&self, offset: u64, expect: u64, tag: u64) -> Result<(), Refusal> {
        let a = self.allocator.lock().expect("allocator lock");
        self.owned(&a, offset, expect)?;
        self.region
            .store(offset, tag)
            .expect("tag inside the region");
        // A client's write that found the old tag was ordered before this point.
        fence(Ordering::SeqCst);
        self.history
            .lock()
            .expect("history lock")
            .retagged(offset, expect);
        Ok(())
    }

    /// Where the stripe extents `asked` (base, tag) are now (see [`rackfs_meta::history`]).
    pub fn resolve(&self, asked: &[(u64, u64)]) -> Resolved {
        let a = self.allocator.lock().expect("allocator lock");
        let live = |base| match a.extent(base) {
            Some((_, Use::Stripe)) => self.region.load(base).ok().filter(|&t| t != 0),
            _ => None,
        };
        self.history
            .lock()
            .expect("history lock")
            .resolve(asked, live)
    }

    /// The base of the allocated extent holding `len` bytes at `offset`, or why there is none.
    fn extent_holding(a: &ExtentAllocator, offset: u64, len: u64) -> Result<u64, Refusal> {
        a.containing(offset, len).ok_or_else(|| {
            Refusal::new(
                ErrorCode::Invalid,
                format!("{len} bytes at {offset:#x} are not inside one allocated extent"),
            )
        })
    }

    /// Copies `len` bytes at `from` of this node's region, data of a stripe extent tagged
    /// `expect`, to `to`, which must lie in one allocated extent: [`Store::pull`] from the
    /// node itself (a trim's copy), without a connection to itself.
    pub fn copy_within(&self, from: u64, to: u64, len: u64, expect: u64) -> Result<(), Refusal> {
        {
            let a = self.allocator.lock().expect("allocator lock");
            Self::extent_holding(&a, to, len)?;
            // The source must be live under `expect` and hold `len` bytes.
            let held = self.owned(&a, from.saturating_sub(TAG_SPACE), expect)?;
            if held < TAG_SPACE + len {
                return Err(Refusal::new(
                    ErrorCode::Invalid,
                    format!("the stripe at {from:#x} holds fewer than {len} bytes"),
                ));
            }
        }
        self.region
            .copy_within(from, to, len)
            .expect("both extents inside the region");
        // Memory the source reused meanwhile is never copied as this stripe (as for a pull).
        let a = self.allocator.lock().expect("allocator lock");
        self.owned(&a, from.saturating_sub(TAG_SPACE), expect)
            .map(|_| ())
    }

    /// Copies `len` bytes at `from` of node `source`'s region (read one-sidedly over tcp, in
    /// pieces of at most 1 MiB) to `to` of this node's, which must lie in one allocated extent.
    pub fn pull(
        &self,
        source: &str,
        secret: &rackfs_verbs::Secret,
        (from, to, len): (u64, u64, u64),
        expect: u64,
    ) -> Result<(), Refusal> {
        const PIECE: u64 = 1 << 20;
        let unavailable = |e: rackfs_verbs::VerbsError| {
            Refusal::new(
                ErrorCode::Unavailable,
                format!("reading from {source}: {e}"),
            )
        };
        Self::extent_holding(&self.allocator.lock().expect("allocator lock"), to, len)?;
        let qp = rackfs_verbs::tcp::connect(source, secret, "rebuild").map_err(unavailable)?;
        let rkey = qp.regions().first().map(|r| r.rkey).ok_or_else(|| {
            Refusal::new(ErrorCode::Unavailable, format!("{source} has no region"))
        })?;
        // The source stripe must carry `expect` before and after: memory the source node
        // reused meanwhile is never copied as this stripe.
        let tagged = || -> Result<(), Refusal> {
            let t = qp
                .read(rackfs_verbs::RemoteAddr::new(rkey, from - TAG_SPACE), 8)
                .map_err(unavailable)?;
            let t = u64::from_le_bytes(t[..8].try_into().expect("8 bytes"));
            if t != expect {
                return Err(Refusal::new(
                    ErrorCode::NotFound,
                    format!(
                        "the stripe at {from:#x} on {source} is tagged {t:#x}, not {expect:#x}"
                    ),
                ));
            }
            Ok(())
        };
        tagged()?;
        let mut at = 0;
        while at < len {
            let n = PIECE.min(len - at);
            let bytes = qp
                .read(rackfs_verbs::RemoteAddr::new(rkey, from + at), n as u32)
                .map_err(unavailable)?;
            self.region
                .write(to + at, &bytes)
                .expect("extent inside the region");
            at += n;
        }
        tagged()
    }

    /// Zeroes `len` bytes at `offset`, which must lie inside one allocated extent (with `tag`:
    /// a stripe extent tagged so).
    pub fn zero(&self, offset: u64, len: u64, tag: Option<u64>) -> Result<(), Refusal> {
        {
            let a = self.allocator.lock().expect("allocator lock");
            let base = Self::extent_holding(&a, offset, len)?;
            if let Some(t) = tag {
                self.owned(&a, base, t)?;
            }
        }
        self.region
            .discard(offset, len)
            .expect("extent inside the region");
        Ok(())
    }

    /// Returns quarantined extents whose time is up to the allocator, zeroed.
    pub fn reap(&self) {
        let now = self.clock.now();
        let due: Quarantine = {
            let mut q = self.quarantine.lock().expect("quarantine lock");
            let (due, keep) = q.drain(..).partition(|e| e.0 <= now);
            *q = keep;
            due
        };
        for (_, offset, len) in due {
            let mut a = self.allocator.lock().expect("allocator lock");
            match a.extent(offset) {
                Some((_, Use::Quarantined)) => {
                    self.region
                        .discard(offset, len)
                        .expect("extent inside the region");
                    a.free(offset).expect("an allocated extent");
                }
                found => warn!(
                    offset,
                    ?found,
                    "a quarantined extent is no longer in quarantine"
                ),
            }
        }
    }

    /// How often [`Store::reap`] should run.
    pub fn reap_interval(&self) -> Duration {
        Duration::from_millis(100).min(self.hold.max(Duration::from_millis(1)))
    }

    /// Fills the memory fields of `s`.
    pub fn fill_stats(&self, s: &mut NodeStats) {
        let a = self.allocator.lock().expect("allocator lock").stats();
        s.capacity = a.capacity;
        s.used = a.used;
        s.free = a.free;
        s.largest_free = a.largest_free;
        s.extents = a.extents;
        s.quarantined = self.quarantined();
    }

    /// Bytes freed but held back from reuse.
    fn quarantined(&self) -> u64 {
        self.quarantine
            .lock()
            .expect("quarantine lock")
            .iter()
            .map(|q| q.2)
            .sum()
    }

    /// Capacity and the bytes files can still have: free, or quarantined (an allocation
    /// waits for the quarantine rather than failing).
    pub fn capacity_free(&self) -> (u64, u64) {
        let a = self.allocator.lock().expect("allocator lock").stats();
        (a.capacity, a.free + self.quarantined())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_verbs::Access;

    fn store() -> Store {
        let region = Region::create_memfd("store-test", 1 << 20, 1, Access::ALL).unwrap();
        let clock = Arc::new(rackfs_clock::ManualClock::default());
        Store::new("test", Arc::new(region), Duration::ZERO, 64 << 10, clock)
    }

    #[test]
    fn extents_placed_ahead_take_what_is_free_and_never_wait_for_quarantine() {
        let region = Region::create_memfd("store-test", 1 << 20, 1, Access::ALL).unwrap();
        let clock = Arc::new(rackfs_clock::ManualClock::default());
        let hour = Duration::from_secs(3600);
        let s = Store::new("test", Arc::new(region), hour, 64 << 10, clock);
        let tags: Vec<u64> = (1..=1000).collect();
        let got = s.alloc_many(4096, 64, &tags).unwrap();
        assert!(
            got.len() > 10 && got.len() < 1000,
            "{} of 1000 fit",
            got.len()
        );
        for (base, tag) in got.iter().zip(&tags) {
            assert_eq!(s.region().load(*base).unwrap(), *tag, "tag written");
        }
        // Full, with an extent quarantined for an hour: a single allocation waits for it (on
        // this manual clock, a sleep moves time on, so it gets it), extents placed ahead do not.
        s.free(got[0], Some(tags[0])).unwrap();
        assert!(s.alloc_many(4096, 64, &[5000]).is_err());
        assert!(
            s.alloc(4096, 64, Some(5001)).is_ok(),
            "the quarantined extent, after its hold"
        );
    }

    /// A free sent again (one that timed out while the node was stopped ran when it resumed,
    /// and the primary sent it again once the node was back) changes nothing: the extent is
    /// reused only after its quarantine, and the quarantine's end does not free the stripe
    /// that took its memory. Before, the second free handed the memory out at once, and the
    /// quarantine's end then freed and zeroed the new stripe under its file.
    #[test]
    fn an_extent_freed_twice_is_reused_only_after_its_quarantine() {
        let region = Region::create_memfd("store-test", 1 << 20, 1, Access::ALL).unwrap();
        let clock = Arc::new(rackfs_clock::ManualClock::default());
        let hold = Duration::from_secs(10);
        let s = Store::new("test", Arc::new(region), hold, 64 << 10, clock.clone());
        let x = s.alloc(4096, 64, Some(7)).unwrap();
        s.free(x, Some(7)).unwrap();
        s.free(x, None).unwrap();
        let mut live = Vec::new();
        while let Ok(y) = s.alloc_many(4096, 64, &[8]) {
            assert_ne!(y[0], x, "an extent in quarantine handed out");
            live.extend(y);
        }
        assert!(!live.is_empty());
        clock.advance(hold);
        s.reap();
        let y = s.alloc(4096, 64, Some(9)).unwrap();
        assert_eq!(y, x, "the extent comes back once its quarantine ended");
        s.reap();
        assert_eq!(
            s.region().load(y).unwrap(),
            9,
            "the new stripe keeps its tag"
        );
        for z in live {
            assert_eq!(s.region().load(z).unwrap(), 8);
        }
    }

    /// A standby taking over keeps the records and tables it mirrored and zeroes the rest of
    /// the metadata area, which may hold what its old primary freed since: what the new
    /// primary allocates there comes zeroed.
    #[test]
    fn a_standby_taking_over_zeroes_what_its_mirror_no_longer_holds() {
        let s = store();
        for at in (META_BASE..s.meta_len()).step_by(8) {
            s.region().store(at, 0xdead).unwrap();
        }
        let (kept, kept_len) = (META_BASE + 8192, 256);
        s.meta_adopt("test", &[(kept, kept_len)]).unwrap();
        for at in (META_BASE..s.meta_len()).step_by(8) {
            let inside = (kept..kept + kept_len).contains(&at);
            let want = if inside { 0xdead } else { 0 };
            assert_eq!(s.region().load(at).unwrap(), want, "at {at}");
        }
        let fresh = s.meta_alloc(4096).unwrap();
        assert!(fresh + 4096 <= kept || fresh >= kept + kept_len);
    }

    /// Memory freed and handed out again under another tag is never changed by a caller that
    /// still names the old tag (a primary that took over with a layout lacking a change).
    #[test]
    fn a_stripe_extent_is_changed_only_under_the_tag_the_caller_expects() {
        let s = store();
        let a = s.alloc(4096, 64, Some(7)).unwrap();
        s.free(a, Some(7)).unwrap();
        s.reap();
        let b = s.alloc(4096, 64, Some(9)).unwrap();
        assert_eq!(a, b, "the freed memory is reused");
        assert!(s.retag(b, 7, 11).is_err());
        assert!(s.resize(b, 1024, 11, 7).is_err());
        assert!(s.zero(b + TAG_SPACE, 16, Some(7)).is_err());
        assert!(s.free(b, Some(7)).is_err());
        assert_eq!(
            s.region().load(b).unwrap(),
            9,
            "the new owner's tag is untouched"
        );
        s.retag(b, 9, 11).unwrap();
        assert!(s.free(b, Some(11)).is_ok());
    }

    /// A trim's copy within the node copies the live stripe's bytes, and refuses a source
    /// that is not the stripe the caller names (or is shorter than asked), and a destination
    /// outside an allocated extent, changing nothing.
    #[test]
    fn a_copy_within_the_node_takes_only_the_stripe_the_caller_names() {
        let s = store();
        let a = s.alloc(8192, 64, Some(7)).unwrap();
        s.region().write(a + TAG_SPACE, b"stripe bytes").unwrap();
        let b = s.alloc(4096, 64, Some(8)).unwrap();
        s.copy_within(a + TAG_SPACE, b + TAG_SPACE, 12, 7).unwrap();
        let mut got = [0u8; 12];
        s.region().read(b + TAG_SPACE, &mut got).unwrap();
        assert_eq!(&got, b"stripe bytes");
        let untouched = |s: &Store| {
            let mut got = [0u8; 12];
            s.region().read(b + TAG_SPACE + 16, &mut got).unwrap();
            got == [0u8; 12]
        };
        assert!(
            s.copy_within(a + TAG_SPACE, b + TAG_SPACE + 16, 12, 9)
                .is_err(),
            "other tag"
        );
        assert!(
            s.copy_within(a + TAG_SPACE, b + TAG_SPACE + 16, 16 << 10, 7)
                .is_err(),
            "longer than the source"
        );
        assert!(
            s.copy_within(a + TAG_SPACE, 1 << 19, 12, 7).is_err(),
            "destination not allocated"
        );
        assert!(
            s.copy_within(3, b + TAG_SPACE, 12, 7).is_err(),
            "no stripe there"
        );
        assert!(untouched(&s));
    }

    /// A moved extent's old copy stays held until freed under its old tag, and a primary that
    /// took over is told where a moved or retagged extent went; once freed, nothing is.
    #[test]
    fn moves_and_retags_are_remembered_until_the_extent_is_freed() {
        let s = store();
        let a = s.alloc(1024, 64, Some(7)).unwrap();
        s.region().write(a + TAG_SPACE, b"kept").unwrap();
        let b = s.resize(a, 4096, 8, 7).unwrap();
        s.retag(b, 8, 9).unwrap();
        let used = s.allocator.lock().unwrap().stats().used;
        s.reap();
        assert_eq!(
            s.allocator.lock().unwrap().stats().used,
            used,
            "the old copy is held"
        );
        let r = s.resolve(&[(a, 7), (b, 9), (b, 8)]);
        assert_eq!(
            r.changed,
            vec![((a, 7), Some((b, 9))), ((b, 8), Some((b, 9)))]
        );
        assert_eq!(r.moved, vec![(a, 7)]);
        assert!(s.free(a, Some(8)).is_err(), "only under the tag it had");
        s.free(a, Some(7)).unwrap();
        s.reap();
        assert!(s.allocator.lock().unwrap().stats().used < used);
        let r = s.resolve(&[(a, 7)]);
        assert_eq!(r.changed, vec![((a, 7), None)]);
        assert!(r.moved.is_empty());
        let mut got = [0; 4];
        s.region().read(b + TAG_SPACE, &mut got).unwrap();
        assert_eq!(&got, b"kept");
    }
}
