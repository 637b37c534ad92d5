//! Per-opcode verb counters kept in region memory.
//!
//! A memory node counts the verbs its NIC threads execute. `shm` clients execute verbs with
//! their own CPU, so the node hands each one a small counter region (a memfd) that the client
//! increments and the node reads: either way the node can report every verb served on its memory.
//! Layout, in 8-byte words: `ops[6]`, `bytes[6]`, `errors`, `batches` (opcode order of
//! [`crate::Opcode::ALL`]). Each block has a single writer (one shm client, or the NIC thread of one
//! connection), so increments are plain stores; readers see each word old or new.

use std::sync::Arc;

use crate::region::Region;
use crate::wr::Access;
use crate::{Batch, Completions};

const WORDS: u64 = 14;
/// Bytes of one counter block.
pub const COUNTER_BLOCK_LEN: u64 = 4096;

/// A snapshot of counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VerbTotals {
    pub ops: [u64; 6],
    pub bytes: [u64; 6],
    pub errors: u64,
    pub batches: u64,
}

impl VerbTotals {
    pub fn add(&mut self, o: &VerbTotals) {
        for i in 0..6 {
            self.ops[i] += o.ops[i];
            self.bytes[i] += o.bytes[i];
        }
        self.errors += o.errors;
        self.batches += o.batches;
    }

    pub fn total_ops(&self) -> u64 {
        self.ops.iter().sum()
    }
}

/// Counters living in a region (heap or memfd).
#[derive(Clone)]
pub struct VerbCounters {
    region: Arc<Region>,
}

impl VerbCounters {
    /// Counters in private heap memory (one NIC thread's).
    pub fn local() -> VerbCounters {
        VerbCounters {
            region: Arc::new(Region::heap(WORDS * 8, 0, Access::ALL)),
        }
    }

    /// Counters in a shared region (an `shm` client's block, as created or received).
    pub fn in_region(region: Arc<Region>) -> VerbCounters {
        assert!(region.len() >= WORDS * 8, "counter region too small");
        VerbCounters { region }
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    fn add(&self, word: u64, v: u64) {
        if v != 0 {
            self.region
                .add_owned_counter(word * 8, v)
                .expect("counter word in bounds");
        }
    }

    /// Records the counts of a whole executed batch.
    pub fn record_batch(&self, batch: &Batch<'_>, done: &Completions) {
        let mut t = VerbTotals::default();
        for (i, wr) in batch.requests().iter().enumerate() {
            if done.status(crate::WrId(i)).is_ok() {
                let op = wr.opcode().index();
                t.ops[op] += 1;
                t.bytes[op] += wr.len();
            } else {
                t.errors += 1;
            }
        }
        t.batches = 1;
        self.add_totals(&t);
    }

    pub fn add_totals(&self, t: &VerbTotals) {
        for i in 0..6 {
            self.add(i as u64, t.ops[i]);
            self.add(6 + i as u64, t.bytes[i]);
        }
        self.add(12, t.errors);
        self.add(13, t.batches);
    }

    pub fn snapshot(&self) -> VerbTotals {
        let mut words = [0u8; (WORDS * 8) as usize];
        self.region
            .read(0, &mut words)
            .expect("counter block in bounds");
        let w = |i: usize| u64::from_le_bytes(words[i * 8..i * 8 + 8].try_into().expect("8"));
        let mut t = VerbTotals::default();
        for i in 0..6 {
            t.ops[i] = w(i);
            t.bytes[i] = w(6 + i);
        }
        t.errors = w(12);
        t.batches = w(13);
        t
    }
}
