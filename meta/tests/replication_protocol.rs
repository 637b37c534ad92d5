//! The replication protocol against an oracle, over many seeds: the service's real code
//! (`rackfs_meta::file::File`: placement on distinct nodes, moving a growing stripe, dropping a
//! dead node, re-replication with retagging) interleaved, at every one of its calls to the data
//! nodes, with clients that write and read one-sidedly by the data path's rules (a write goes
//! to every replica in the table entry, then checks each replica's tag, and is redone on a
//! fresh layout if a tag no longer matches or a node failed and was dropped; a read goes to one
//! replica and checks its tag; a moving entry is asked again later). Nodes are killed at random
//! and declared dead later.
//!
//! The oracle: a read never returns a value older than the last write acknowledged before it
//! started; at the end every live replica in the table holds the last acknowledged write of its
//! stripe (an acknowledged write is never lost); a stripe's replicas are on distinct nodes.
//! `RACKFS_REPLICATION_SEEDS=N` runs more seeds.

use std::sync::{Arc, Mutex};

use rackfs_meta::file::{Dropped, File};
use rackfs_meta::{MemStorage, Storage};
use rackfs_proto::namespace::StripeExtent;
use rackfs_proto::record::{
    entry_offset, split_location, ENTRY_LEN, REC_TABLE, TAG_MOVING, TAG_SPACE,
};

const NODES: u32 = 4;
const STRIPES: u64 = 3;
const UNIT: u64 = 4096;
const INO: u64 = 7;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// One client operation in progress.
enum Op {
    /// Writing `value` to stripe `k`: `replicas` as read from the table, `step` 2j writes
    /// replica j's data, 2j+1 reads its tag.
    Write {
        k: u64,
        value: u64,
        replicas: Vec<StripeExtent>,
        step: usize,
    },
    /// Reading stripe `k` from `replica`: the data first (`got`), then the tag. `floor`: the
    /// last write acknowledged when the read started.
    Read {
        k: u64,
        floor: u64,
        replica: Option<StripeExtent>,
        got: Option<u64>,
    },
}

/// Everything the clients and the oracle know; shared with the storage hook.
struct World {
    rng: Rng,
    record: u64,
    replicas: u32,
    /// Nodes killed (their memory unreachable to clients).
    down: Vec<u32>,
    ops: Vec<Option<Op>>,
    next_value: u64,
    /// Per stripe, the last acknowledged value.
    acked: Vec<u64>,
    /// Per stripe, whether a write is in flight (the range lock: one writer per stripe).
    writing: Vec<bool>,
    violations: Vec<String>,
    /// What happened: writes acknowledged, reads checked.
    writes: u64,
    reads: u64,
}

/// What a run exercised (a run that exercised nothing proves nothing).
#[derive(Default)]
struct Coverage {
    writes: u64,
    reads: u64,
    copies: u64,
    moves: u64,
    kills: u64,
}

impl World {
    /// The stripe's replicas as the table holds them (`None`: the entry is moving).
    fn entry(&self, st: &MemStorage, k: u64) -> Option<Vec<StripeExtent>> {
        let r0 = st.region(0);
        let table = r0.load(self.record + REC_TABLE).unwrap();
        let mut v = Vec::new();
        for j in 0..self.replicas as u64 {
            let at = entry_offset(table, k, self.replicas) + j * ENTRY_LEN;
            let (loc, tag) = (r0.load(at).unwrap(), r0.load(at + 8).unwrap());
            if tag == TAG_MOVING {
                return None;
            }
            if tag != 0 && loc != 0 {
                let (node, offset) = split_location(loc);
                v.push(StripeExtent { node, offset, tag });
            }
        }
        Some(v)
    }

    /// Runs one step of a random client (starting an operation if it is idle).
    fn step(&mut self, st: &MemStorage) {
        let c = self.rng.below(self.ops.len() as u64) as usize;
        let op = match self.ops[c].take() {
            Some(op) => op,
            None => {
                let k = self.rng.below(STRIPES);
                if self.rng.below(2) == 0 && !self.writing[k as usize] {
                    self.writing[k as usize] = true;
                    self.next_value += 1;
                    Op::Write {
                        k,
                        value: self.next_value,
                        replicas: Vec::new(),
                        step: usize::MAX, // read the layout first
                    }
                } else {
                    Op::Read {
                        k,
                        floor: self.acked[k as usize],
                        replica: None,
                        got: None,
                    }
                }
            }
        };
        self.ops[c] = self.advance(st, op);
    }

    /// One step of `op`; `None` when it finished.
    fn advance(&mut self, st: &MemStorage, op: Op) -> Option<Op> {
        match op {
            Op::Write {
                k,
                value,
                replicas,
                step,
            } => {
                if step == usize::MAX {
                    // (Re)read the layout; a moving entry is asked again later.
                    return match self.entry(st, k) {
                        None => Some(Op::Write {
                            k,
                            value,
                            replicas,
                            step,
                        }),
                        Some(r) if r.iter().all(|e| self.down.contains(&e.node)) => {
                            // Every replica on a dead node: the write fails (EIO).
                            self.writing[k as usize] = false;
                            None
                        }
                        Some(r) if r.iter().any(|e| self.down.contains(&e.node)) => {
                            // A replica on a failed node: wait until it is dropped.
                            Some(Op::Write {
                                k,
                                value,
                                replicas: r,
                                step,
                            })
                        }
                        Some(r) => Some(Op::Write {
                            k,
                            value,
                            replicas: r,
                            step: 0,
                        }),
                    };
                }
                if step == 2 * replicas.len() {
                    self.writes += 1;
                    self.acked[k as usize] = value;
                    self.writing[k as usize] = false;
                    return None;
                }
                let e = replicas[step / 2];
                let restart = Some(Op::Write {
                    k,
                    value,
                    replicas: replicas.clone(),
                    step: usize::MAX,
                });
                if self.down.contains(&e.node) {
                    return restart; // the node failed: redone once it is dropped
                }
                let r = st.region(e.node);
                if step % 2 == 0 {
                    r.store(e.offset, value).unwrap();
                } else if r.load(e.offset - TAG_SPACE).unwrap() != e.tag {
                    return restart; // a stale layout: redone
                }
                Some(Op::Write {
                    k,
                    value,
                    replicas,
                    step: step + 1,
                })
            }
            Op::Read {
                k,
                floor,
                replica,
                got,
            } => {
                let again = Op::Read {
                    k,
                    floor,
                    replica: None,
                    got: None,
                };
                let Some(e) = replica else {
                    let Some(r) = self.entry(st, k) else {
                        return Some(again);
                    };
                    let live: Vec<StripeExtent> = r
                        .into_iter()
                        .filter(|e| !self.down.contains(&e.node))
                        .collect();
                    if live.is_empty() {
                        return None; // EIO: no replica reachable
                    }
                    let e = live[self.rng.below(live.len() as u64) as usize];
                    return Some(Op::Read {
                        k,
                        floor,
                        replica: Some(e),
                        got: None,
                    });
                };
                if self.down.contains(&e.node) {
                    return Some(again); // another replica
                }
                let r = st.region(e.node);
                match got {
                    None => Some(Op::Read {
                        k,
                        floor,
                        replica,
                        got: Some(r.load(e.offset).unwrap()),
                    }),
                    Some(v) => {
                        if r.load(e.offset - TAG_SPACE).unwrap() != e.tag {
                            return Some(again);
                        }
                        self.reads += 1;
                        if v < floor {
                            self.violations.push(format!(
                                "stripe {k}: read {v} from node {} after {floor} was acknowledged",
                                e.node
                            ));
                        }
                        None
                    }
                }
            }
        }
    }
}

fn run(seed: u64, cov: &mut Coverage) -> Result<(), String> {
    let st = MemStorage::new(NODES, 1 << 22);
    let (_, region) = st.local();
    let record = st.alloc(0, 64, None).unwrap();
    let mut f = File::new(record, UNIT, 2, region);
    for k in 0..STRIPES {
        // Stripe 0 starts small and grows (moves) later.
        let end = if k == 0 { 64 } else { UNIT };
        f.alloc_stripe(INO, k, end, k + 1, &st).unwrap();
    }
    let world = Arc::new(Mutex::new(World {
        rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
        record,
        replicas: 2,
        down: Vec::new(),
        ops: (0..3).map(|_| None).collect(),
        next_value: 0,
        acked: vec![0; STRIPES as usize],
        writing: vec![false; STRIPES as usize],
        violations: Vec::new(),
        writes: 0,
        reads: 0,
    }));
    // Every call the service makes to a data node may let clients take a few steps first.
    {
        let w = world.clone();
        st.set_hook(Box::new(move |st| {
            let mut w = w.lock().unwrap();
            for _ in 0..w.rng.below(4) {
                w.step(st);
            }
        }));
    }
    let mut serial = 100;
    let mut killed: Vec<u32> = Vec::new();
    let mut dropped: Vec<u32> = Vec::new();
    for _ in 0..400 {
        let what = world.lock().unwrap().rng.below(100);
        serial += 1;
        match what {
            0..=79 => world.lock().unwrap().step(&st),
            80..=86 => {
                for k in f.degraded_stripes(8) {
                    let n = f.rebuild(INO, k, serial, &st).map_err(|e| e.message)?;
                    cov.copies += u64::from(n > 0);
                    serial += 1;
                }
            }
            87..=89 => {
                // Stripe 0 grows: its replicas move to larger extents.
                let before = f.stripe(0);
                let _ = f.alloc_stripe(INO, 0, UNIT, serial, &st);
                cov.moves += u64::from(f.stripe(0) != before);
            }
            90..=92 if killed.len() < 2 => {
                let node = 1 + world.lock().unwrap().rng.below(NODES as u64 - 1) as u32;
                if !killed.contains(&node) {
                    killed.push(node);
                    cov.kills += 1;
                    st.set_down(node);
                    world.lock().unwrap().down.push(node);
                }
            }
            93..=99 => {
                // A killed node's lease lapses: it is declared dead and dropped.
                if let Some(&node) = killed.iter().find(|n| !dropped.contains(n)) {
                    dropped.push(node);
                    let mut d = Dropped::default();
                    f.drop_node(node, region, &mut d);
                }
            }
            _ => {}
        }
    }
    // Finish: every node killed is dropped, copies are made, and the clients run to the end.
    for &node in killed.iter().filter(|n| !dropped.contains(n)) {
        let mut d = Dropped::default();
        f.drop_node(node, region, &mut d);
    }
    for k in f.degraded_stripes(8) {
        serial += 1;
        f.rebuild(INO, k, serial, &st).map_err(|e| e.message)?;
    }
    let mut w = world.lock().unwrap();
    for _ in 0..10_000 {
        if w.ops.iter().all(Option::is_none) {
            break;
        }
        let c = w.ops.iter().position(Option::is_some).unwrap();
        let op = w.ops[c].take().unwrap();
        w.ops[c] = w.advance(&st, op);
    }
    cov.writes += w.writes;
    cov.reads += w.reads;
    if !w.violations.is_empty() {
        return Err(w.violations.join("; "));
    }
    for k in 0..STRIPES {
        let replicas = w.entry(&st, k).ok_or(format!("stripe {k} left moving"))?;
        let mut nodes: Vec<u32> = replicas.iter().map(|e| e.node).collect();
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.len() != replicas.len() {
            return Err(format!(
                "stripe {k}: two replicas on one node: {replicas:?}"
            ));
        }
        for e in replicas.iter().filter(|e| !w.down.contains(&e.node)) {
            let v = st.region(e.node).load(e.offset).unwrap();
            if v != w.acked[k as usize] {
                return Err(format!(
                    "stripe {k}: node {} holds {v}, the last acknowledged write was {}",
                    e.node, w.acked[k as usize]
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn acknowledged_writes_survive_kills_moves_and_copies_over_many_seeds() {
    let seeds: u64 = std::env::var("RACKFS_REPLICATION_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let mut cov = Coverage::default();
    for seed in 0..seeds {
        if let Err(e) = run(seed, &mut cov) {
            panic!("seed {seed}: {e}");
        }
    }
    eprintln!(
        "{seeds} seeds: {} writes acknowledged, {} reads checked, {} stripes copied, {} moves, \
         {} nodes killed",
        cov.writes, cov.reads, cov.copies, cov.moves, cov.kills
    );
    assert!(
        cov.writes > seeds * 20 && cov.reads > seeds * 20 && cov.copies > seeds / 2,
        "the runs exercised too little to prove anything"
    );
}
