//! Record locks (`rackfs_locks::record`) under the deterministic simulator: clients with two
//! lock owners each set, convert, split and clear random byte ranges, waiting (as `F_SETLKW`
//! does) by polling the table's version; messages are delayed at random, clients paused and
//! killed, and the service's sweep (`rackfs_meta::recordlocks::sweep`) frees what the dead
//! held. The oracle fails a seed if two owners ever hold conflicting locks on one byte at
//! once (exclusion), or if a live owner's request is not granted by the end of the run
//! (liveness: the dead and the stopped never block others for good). A failure names its
//! seed; `RACKFS_RECLOCK_SEED=N` replays just that one.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use rackfs_locks::record::{Mode, RecordLockTable, Refused, Want, TABLE_LEN};
use rackfs_meta::recordlocks::sweep;
use rackfs_verbs::sim::{Sim, SimConfig, SimHandle, SIM_RKEY};
use rackfs_verbs::RemoteAddr;

/// Bytes the ranges are drawn over; `INF` ranges reach beyond.
const BYTES: u64 = 40;
const OWNERS_PER_CLIENT: usize = 2;

/// What each owner holds, byte by byte (byte `BYTES` stands for every byte beyond).
#[derive(Default)]
struct Oracle {
    held: BTreeMap<(usize, u64), bool>,
    violations: Vec<String>,
    grants: u64,
    waits: u64,
    done: usize,
    freed: u64,
}

fn bytes(w: &Want) -> std::ops::RangeInclusive<u64> {
    w.start..=(w.end.min(BYTES + 1) - 1)
}

impl Oracle {
    /// Before a request is sent: the owner stops relying on what it gives up (all of the
    /// range for an unlock, exclusive bytes turning shared).
    /// Returns what it gave up, to hold again if the request is refused.
    fn before(&mut self, who: usize, w: &Want) -> Vec<(usize, u64)> {
        let mut gave = Vec::new();
        for b in bytes(w) {
            let gives = w.mode == Mode::Unlock || self.held.get(&(who, b)) == Some(&true);
            if gives && self.held.remove(&(who, b)).is_some() {
                gave.push((who, b));
            }
        }
        gave
    }

    /// A request was granted at `now`: the owner holds the range; nobody else may hold a
    /// conflicting lock on any byte of it.
    fn granted(&mut self, who: usize, w: &Want, now: Duration) {
        if w.mode == Mode::Unlock {
            return;
        }
        let excl = w.mode == Mode::Exclusive;
        for b in bytes(w) {
            for (&(other, byte), &e) in self.held.range((0, b)..) {
                if byte == b && other != who && (e || excl) {
                    self.violations.push(format!(
                        "owner {who} got {:?} of byte {b} while owner {other} holds it (exclusive: {e}) at {now:?}",
                        w.mode
                    ));
                }
            }
        }
        for b in bytes(w) {
            self.held.insert((who, b), excl);
        }
        self.grants += 1;
    }

    fn forget(&mut self, owners: &[usize]) {
        self.held.retain(|&(o, _), _| !owners.contains(&o));
    }
}

fn pick(h: &SimHandle, client: u16, owner: u64, mode: Mode) -> Want {
    let start = h.random_below(BYTES);
    let end = match h.random_below(5) {
        0 => u64::MAX,
        _ => (start + 1 + h.random_below(12)).min(BYTES),
    };
    Want {
        client,
        host: 1,
        owner,
        pid: owner as u32,
        start,
        end,
        mode,
    }
}

fn run(seed: u64) -> Result<String, String> {
    let mut sim = Sim::new(SimConfig {
        seed,
        region_len: 1 << 16,
        ..SimConfig::default()
    });
    let base = RemoteAddr::new(SIM_RKEY, 0);
    let oracle = Rc::new(RefCell::new(Oracle::default()));
    let clients = 3;
    let ops = 12;
    let mut ids = Vec::new();
    for c in 0..clients {
        let id = sim.add_client();
        ids.push(id);
        for k in 0..OWNERS_PER_CLIENT {
            let who = c * OWNERS_PER_CLIENT + k;
            let qp = sim.handle().connect(id);
            let h = sim.handle();
            let o = oracle.clone();
            sim.spawn(id, async move {
                let t = RecordLockTable::new(qp, base, c as u16, Duration::from_secs(1));
                let owner = 1000 + who as u64;
                for _ in 0..ops {
                    // Wait (like F_SETLKW) for a lock, holding nothing.
                    let mode = if h.random_below(2) == 0 {
                        Mode::Shared
                    } else {
                        Mode::Exclusive
                    };
                    let w = pick(&h, c as u16, owner, mode);
                    loop {
                        let seen = t.version().await.expect("version");
                        match t.apply(&w).await.expect("apply") {
                            Ok(_) => break,
                            Err(Refused::Full) => panic!("table full"),
                            Err(Refused::Conflict(_)) => o.borrow_mut().waits += 1,
                        }
                        let mut pause = Duration::from_micros(1);
                        while t.version().await.expect("version") == seen {
                            h.clock_sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_micros(50));
                        }
                    }
                    o.borrow_mut().granted(who, &w, h.now());
                    // While holding: try a conversion or an extension once, and clear a part.
                    for _ in 0..h.random_below(3) {
                        let mode = match h.random_below(3) {
                            0 => Mode::Shared,
                            1 => Mode::Exclusive,
                            _ => Mode::Unlock,
                        };
                        let w2 = pick(&h, c as u16, owner, mode);
                        let gave = o.borrow_mut().before(who, &w2);
                        match t.apply(&w2).await.expect("apply") {
                            Ok(_) => o.borrow_mut().granted(who, &w2, h.now()),
                            // Refused: the table is unchanged, so is what the owner holds.
                            Err(_) => o
                                .borrow_mut()
                                .held
                                .extend(gave.into_iter().map(|k| (k, true))),
                        }
                        h.clock_sleep(Duration::from_nanos(h.random_below(4_000)))
                            .await;
                    }
                    h.clock_sleep(Duration::from_nanos(h.random_below(8_000)))
                        .await;
                    let all = Want {
                        start: 0,
                        end: u64::MAX,
                        mode: Mode::Unlock,
                        ..w
                    };
                    o.borrow_mut().before(who, &all);
                    t.apply(&all)
                        .await
                        .expect("apply")
                        .expect("an unlock is never refused");
                }
                o.borrow_mut().done += 1;
            });
        }
    }
    // Faults: pauses (some while holding the mutex), then one kill; the service sweeps the
    // dead client's entries at once and its mutex only after a while, as on a real node.
    let ctl = sim.add_client();
    let h = sim.handle();
    let victims = ids.clone();
    let o = oracle.clone();
    let killed = Rc::new(RefCell::new(None));
    let k = killed.clone();
    sim.spawn(ctl, async move {
        for _ in 0..3 {
            h.clock_sleep(Duration::from_micros(h.random_below(100)))
                .await;
            let v = victims[h.random_below(victims.len() as u64) as usize];
            h.pause(v, Duration::from_micros(h.random_below(300)));
        }
        h.clock_sleep(Duration::from_micros(h.random_below(150)))
            .await;
        let v = h.random_below(victims.len() as u64) as usize;
        h.kill(victims[v]);
        *k.borrow_mut() = Some(v);
        let owners: Vec<usize> = (0..OWNERS_PER_CLIENT)
            .map(|j| v * OWNERS_PER_CLIENT + j)
            .collect();
        o.borrow_mut().forget(&owners);
        let region = h.region();
        for round in 0..40 {
            let freed = sweep(&region, base.offset, v as u16, round >= 20);
            o.borrow_mut().freed += freed;
            h.clock_sleep(Duration::from_micros(5)).await;
        }
    });
    const { assert!(TABLE_LEN < 1 << 16) };
    sim.run(Duration::from_secs(2));
    let o = oracle.borrow();
    if let Some(v) = o.violations.first() {
        return Err(format!("seed {seed}: exclusion violated: {v}"));
    }
    let expected = (clients - 1) * OWNERS_PER_CLIENT;
    if o.done < expected {
        return Err(format!(
            "seed {seed}: liveness: {} of {expected} live owners done at {:?}",
            o.done,
            sim.handle().now()
        ));
    }
    Ok(format!(
        "{} grants, {} waits, {} freed",
        o.grants, o.waits, o.freed
    ))
}

fn seeds() -> Vec<u64> {
    match std::env::var("RACKFS_RECLOCK_SEED") {
        Ok(s) => vec![s.parse().expect("RACKFS_RECLOCK_SEED is a number")],
        Err(_) => (0..10_000).collect(),
    }
}

#[test]
fn record_locks_exclude_and_progress_under_delays_pauses_and_kills() {
    let (mut grants, mut waits, mut freed) = (0u64, 0u64, 0u64);
    for seed in seeds() {
        let summary = run(seed).unwrap_or_else(|e| panic!("{e}"));
        let n: Vec<u64> = summary
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|s| s.parse().ok())
            .collect();
        grants += n[0];
        waits += n[1];
        freed += n[2];
    }
    eprintln!("{grants} grants, {waits} conflicts waited out, {freed} dead entries freed");
    // The runs did contend, and the dead did hold locks that had to be freed.
    assert!(waits > 0 && freed > 0);
}
