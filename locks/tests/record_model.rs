//! POSIX record-lock semantics (`rackfs_locks::record::plan`) against a byte-by-byte
//! reference model: random set and unlock requests of a few owners over a small file must
//! get the same grants and refusals as the model, leave every owner holding exactly the
//! model's bytes in the model's modes, and keep each owner's locks merged (no two of its
//! entries of one mode overlap or touch).

use std::collections::BTreeMap;

use proptest::prelude::*;
use rackfs_locks::record::{plan, Entry, Mode, Refused, Want};

const BYTES: u64 = 48;
/// "To the end of file and beyond": the model's byte `BYTES` stands for every byte from there
/// on, which only such ranges reach.
const INF: u64 = u64::MAX;

/// Per byte, per (client, owner): the mode held.
#[derive(Default)]
struct Model(Vec<BTreeMap<(u16, u64), bool>>);

impl Model {
    fn new() -> Model {
        Model(vec![BTreeMap::new(); BYTES as usize + 1])
    }

    fn bytes(w: &Want) -> std::ops::Range<usize> {
        w.start as usize..w.end.min(BYTES + 1) as usize
    }

    fn conflicts(&self, w: &Want) -> bool {
        w.mode != Mode::Unlock
            && self.0[Self::bytes(w)].iter().any(|held| {
                held.iter().any(|(&who, &excl)| {
                    who != (w.client, w.owner) && (excl || w.mode == Mode::Exclusive)
                })
            })
    }

    fn apply(&mut self, w: &Want) {
        for b in Self::bytes(w) {
            match w.mode {
                Mode::Unlock => self.0[b].remove(&(w.client, w.owner)),
                m => self.0[b].insert((w.client, w.owner), m == Mode::Exclusive),
            };
        }
    }
}

fn want() -> impl Strategy<Value = Want> {
    (
        0u16..2,
        0u64..3,
        0u64..BYTES,
        prop_oneof![1u64..12, Just(INF)],
        prop_oneof![
            Just(Mode::Shared),
            Just(Mode::Exclusive),
            Just(Mode::Unlock)
        ],
    )
        .prop_map(|(client, owner, start, len, mode)| Want {
            client,
            host: 1,
            owner,
            pid: owner as u32,
            start,
            end: if len == INF {
                INF
            } else {
                (start + len).min(BYTES)
            },
            mode,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn record_locks_match_the_byte_model(ops in prop::collection::vec(want(), 1..60)) {
        let mut slots: Vec<Option<Entry>> = vec![None; 64];
        let mut m = Model::new();
        for w in ops {
            let refused = m.conflicts(&w);
            match plan(&slots, &w) {
                Ok(writes) => {
                    prop_assert!(!refused, "{:?} granted over a conflict", w);
                    for (i, e) in writes {
                        // Only the owner's entries and free ones change.
                        prop_assert!(slots[i].is_none_or(|o| (o.client, o.owner) == (w.client, w.owner)));
                        slots[i] = e;
                    }
                    m.apply(&w);
                }
                Err(Refused::Conflict(e)) => {
                    prop_assert!(refused, "{:?} refused for {:?}", w, e);
                    prop_assert!(e.start < w.end && w.start < e.end && (e.client, e.owner) != (w.client, w.owner));
                }
                Err(Refused::Full) => prop_assert!(false, "64 entries ran out"),
            }
            // Every owner holds exactly the model's bytes.
            for b in 0..=BYTES {
                let mut got: BTreeMap<(u16, u64), bool> = BTreeMap::new();
                for e in slots.iter().flatten().filter(|e| e.start <= b && b < e.end) {
                    prop_assert!(got.insert((e.client, e.owner), e.exclusive).is_none(), "two entries of one owner cover byte {}", b);
                }
                prop_assert_eq!(&got, &m.0[b as usize], "byte {}", b);
            }
            // Merged: an owner's entries of one mode never overlap or touch.
            let all: Vec<Entry> = slots.iter().flatten().copied().collect();
            for (i, a) in all.iter().enumerate() {
                for b in &all[i + 1..] {
                    if (a.client, a.owner, a.exclusive) == (b.client, b.owner, b.exclusive) {
                        prop_assert!(a.end < b.start || b.end < a.start, "{:?} and {:?} not merged", a, b);
                    }
                }
            }
        }
    }
}
