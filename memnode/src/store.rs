//! The node's memory: its data region, the extent allocator over it, and the quarantine that
//! holds freed file stripes back from reuse.
//!
//! Remote memory ownership: the store writes region memory only to write a stripe's owner tag
//! when it hands the stripe out, to tombstone it (0) when it is freed, and to zero extents
//! (freed ones, and `Zero` requests for truncate); everything else is written by clients through
//! verbs into extents the allocator handed out (see `rackfs_proto::record`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rackfs_proto::control::{ErrorCode, NodeStats};
use rackfs_proto::record::TAG_SPACE;
use rackfs_proto::Refusal;
use rackfs_verbs::Region;
use tracing::warn;

use crate::alloc::{AllocError, ExtentAllocator};

/// Tagged extents freed and not yet reusable: (reusable at, offset, length).
type Quarantine = Vec<(Instant, u64, u64)>;

/// The data region with its allocator and quarantine.
pub struct Store {
    region: Arc<Region>,
    allocator: Mutex<ExtentAllocator>,
    quarantine: Mutex<Quarantine>,
    hold: Duration,
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
    /// A store over `region`; freed stripes are held back for `hold`.
    pub fn new(name: &str, region: Arc<Region>, hold: Duration) -> Store {
        let len = region.info().len;
        Store {
            region,
            allocator: Mutex::new(ExtentAllocator::new(name, 0, len)),
            quarantine: Mutex::new(Vec::new()),
            hold,
        }
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Allocates an extent; a tagged one (a file stripe) gets [`TAG_SPACE`] in front of its
    /// data and its tag written before it is handed out.
    pub fn alloc(&self, len: u64, align: u64, tag: Option<u64>) -> Result<u64, AllocError> {
        let (len, align) = match tag {
            Some(_) => (
                len.checked_add(TAG_SPACE)
                    .ok_or_else(|| AllocError::Invalid("length overflows".into()))?,
                align.max(TAG_SPACE),
            ),
            None => (len, align),
        };
        let offset = self
            .allocator
            .lock()
            .expect("allocator lock")
            .alloc_tagged(len, align, tag.is_some())?;
        if let Some(t) = tag {
            self.region.store(offset, t).expect("tag inside the region");
        }
        Ok(offset)
    }

    /// Frees an extent: plain extents are zeroed and reusable at once; tagged ones are
    /// tombstoned and quarantined first. Returns the extent's length.
    pub fn free(&self, offset: u64) -> Result<u64, AllocError> {
        let mut a = self.allocator.lock().expect("allocator lock");
        let (len, tagged) = a
            .extent(offset)
            .ok_or(AllocError::NotAllocated { offset })?;
        if tagged {
            self.region.store(offset, 0).expect("tag inside the region");
            a.mark_untagged(offset);
            drop(a);
            self.quarantine.lock().expect("quarantine lock").push((
                Instant::now() + self.hold,
                offset,
                len,
            ));
            Ok(len)
        } else {
            self.region
                .discard(offset, len)
                .expect("extent inside the region");
            a.free(offset)
        }
    }

    /// Zeroes `len` bytes at `offset`, which must lie inside one allocated extent.
    pub fn zero(&self, offset: u64, len: u64) -> Result<(), Refusal> {
        let inside = self
            .allocator
            .lock()
            .expect("allocator lock")
            .containing(offset, len)
            .is_some();
        if !inside {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!("{len} bytes at {offset:#x} are not inside one allocated extent"),
            ));
        }
        self.region
            .discard(offset, len)
            .expect("extent inside the region");
        Ok(())
    }

    /// Returns quarantined extents whose time is up to the allocator, zeroed.
    pub fn reap(&self) {
        let now = Instant::now();
        let due: Quarantine = {
            let mut q = self.quarantine.lock().expect("quarantine lock");
            let (due, keep) = q.drain(..).partition(|e| e.0 <= now);
            *q = keep;
            due
        };
        for (_, offset, len) in due {
            self.region
                .discard(offset, len)
                .expect("extent inside the region");
            if let Err(e) = self.allocator.lock().expect("allocator lock").free(offset) {
                warn!(error = %e, "quarantined extent vanished");
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
        s.quarantined = self
            .quarantine
            .lock()
            .expect("quarantine lock")
            .iter()
            .map(|q| q.2)
            .sum();
    }

    /// Capacity and free bytes.
    pub fn capacity_free(&self) -> (u64, u64) {
        let a = self.allocator.lock().expect("allocator lock").stats();
        (a.capacity, a.free)
    }
}
