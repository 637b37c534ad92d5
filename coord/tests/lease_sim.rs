//! The lease protocol under simulation, over many seeds: the real embedded coordinator
//! ([`Local`], on a simulated clock) and the real holder rules ([`claim`], [`renew`],
//! [`Held`]) driven by candidates for the primary's key and data nodes holding their
//! membership keys, with random message delays (some longer than a lease), pauses and kills of
//! every process, and pauses of the coordinator itself. Each event is checked by an oracle:
//!
//! * no two primaries act at once (a candidate acts while its [`Held`] is valid);
//! * once the primary's member check saw a node's key gone (or under another epoch) and so
//!   dropped it from the replicas, that node never serves again under the epoch it had
//!   (writes go on without it, so anything it served would be stale);
//! * deposed means silent: a primary's write to the coordinator (the daemon's `standby` key,
//!   say), sent while it believed itself primary but arriving any time later, lands only while
//!   its election still holds ([`Coordinator::write_if`] under the primary's [`Guard`]). Made
//!   with a plain `put` instead, a paused primary's late write lands after another was
//!   elected: [`without_the_guard_a_deposed_primary_writes`] shows the oracle catches that.
//!
//! `RACKFS_LEASE_SEEDS=N` runs more seeds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::{Clock, ManualClock};
use rackfs_coord::{
    claim, renew, renew_every, Claimed, CoordError, Coordinator, Guard, Held, LeaseId, Local, Write,
};

const TTL: Duration = Duration::from_millis(1000);
const CANDIDATES: usize = 3;
const MEMBERS: usize = 3;
const RUN: Duration = Duration::from_secs(20);
/// How often the primary reads the members (an eighth of a lease, as the daemon does).
const CHECK: Duration = Duration::from_millis(125);

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
    fn ms(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.below(max + 1))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Candidate,
    Member(usize),
}

/// A request on its way: sent at `sent`, processed by the coordinator at `arrive`, its answer
/// back at `deliver`.
struct InFlight {
    sent: Duration,
    arrive: Duration,
    deliver: Duration,
    answer: Option<Answer>,
}

/// A primary's write on its way to the coordinator: sent while it believed itself primary of
/// `epoch`, under `guard`.
struct PrimaryWrite {
    arrive: Duration,
    guard: Guard,
    epoch: u64,
}

enum Answer {
    Claimed(Result<Result<Claimed, Vec<u8>>, CoordError>),
    Registered(Result<Held, CoordError>),
    Renewed(Held, Result<(), CoordError>),
}

struct Actor {
    kind: Kind,
    held: Option<Held>,
    /// A candidate's election epoch, while it holds the primary's key.
    epoch: Option<u64>,
    /// Alive, and paused until when.
    alive: bool,
    paused_until: Duration,
    next_step: Duration,
    request: Option<InFlight>,
}

impl Actor {
    fn new(kind: Kind, at: Duration) -> Actor {
        Actor {
            kind,
            held: None,
            epoch: None,
            alive: true,
            paused_until: Duration::ZERO,
            next_step: at,
            request: None,
        }
    }

    /// Whether it acts at `now`: serves data, or acts as primary.
    fn acts(&self, now: Duration) -> bool {
        self.alive && now >= self.paused_until && self.held.is_some_and(|h| h.valid(now))
    }
}

#[derive(Default)]
struct Coverage {
    primaries: u64,
    drops: u64,
    renewals: u64,
    expired: u64,
    /// Primaries' writes that landed, and those refused as deposed.
    written: u64,
    refused: u64,
}

/// One seed. `guarded`: primaries write under their election's guard (the daemon's rule);
/// without, with a plain put (the mutation the oracle must catch).
fn run(seed: u64, guarded: bool, cov: &mut Coverage) -> Result<(), String> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let clock = Arc::new(ManualClock::default());
    let c = Local::with_clock(TTL / 4, clock.clone());
    // The coordinator's clock follows the simulation's (which never goes back).
    let set = |t: Duration| clock.advance(t.saturating_sub(clock.now()));
    let kinds = (0..CANDIDATES)
        .map(|_| Kind::Candidate)
        .chain((0..MEMBERS).map(Kind::Member));
    let mut actors: Vec<Actor> = kinds.map(|k| Actor::new(k, rng.ms(50))).collect();
    // The coordinator is paused until then (requests wait for it).
    let mut coord_paused_until = Duration::ZERO;
    // The primary's view: the epoch it last saw each member under, and the epochs dropped.
    let mut seen: BTreeMap<usize, LeaseId> = BTreeMap::new();
    let mut dropped: Vec<(usize, LeaseId)> = Vec::new();
    let mut next_check = CHECK;
    let mut primaries_seen: Vec<LeaseId> = Vec::new();
    // Primaries' writes in flight (they outlive a killed sender, as a packet does).
    let mut writes: Vec<PrimaryWrite> = Vec::new();
    let mut now = Duration::ZERO;
    while now < RUN {
        // The next event: an actor's step, a request's arrival or delivery, a member check.
        let mut t = next_check.max(coord_paused_until);
        for w in &writes {
            t = t.min(w.arrive.max(coord_paused_until));
        }
        for a in &actors {
            if !a.alive {
                continue;
            }
            match &a.request {
                Some(r) if r.answer.is_none() => t = t.min(r.arrive.max(coord_paused_until)),
                Some(r) => t = t.min(r.deliver.max(a.paused_until)),
                None => t = t.min(a.next_step.max(a.paused_until)),
            }
        }
        now = t.max(now);
        // The coordinator answers what reached it (once it is not paused).
        if now >= coord_paused_until {
            set(now);
            for a in actors.iter_mut().filter(|a| a.alive) {
                let kind = a.kind;
                let held = a.held;
                let Some(r) = a
                    .request
                    .as_mut()
                    .filter(|r| r.answer.is_none() && r.arrive <= now)
                else {
                    continue;
                };
                r.answer = Some(match (kind, held) {
                    (_, Some(mut h)) => {
                        let res = renew(&c, &mut h, r.sent);
                        Answer::Renewed(h, res)
                    }
                    (Kind::Candidate, None) => {
                        Answer::Claimed(claim(&c, "primary", b"candidate", TTL, r.sent))
                    }
                    (Kind::Member(j), None) => {
                        Answer::Registered(c.grant(TTL).and_then(|(lease, ttl)| {
                            c.put(&format!("nodes/{j}"), &lease.to_le_bytes(), Some(lease))?;
                            Ok(Held::new(lease, r.sent, ttl))
                        }))
                    }
                });
                r.deliver = r.deliver.max(now + rng.ms(5));
            }
            // Primaries' writes that arrived: each must come from the primary of now.
            for w in writes.iter().filter(|w| w.arrive <= now) {
                let write = Write::Put {
                    key: "standby".into(),
                    value: w.epoch.to_le_bytes().to_vec(),
                    lease: None,
                };
                let landed = if guarded {
                    match c.write_if(&w.guard, write) {
                        Ok(()) => true,
                        Err(CoordError::NotHeld { .. }) => false,
                        Err(e) => return Err(format!("guarded write failed: {e}")),
                    }
                } else {
                    let Write::Put { key, value, lease } = write else {
                        unreachable!("a put")
                    };
                    c.put(&key, &value, lease).map_err(|e| e.to_string())?;
                    true
                };
                if !landed {
                    cov.refused += 1;
                    continue;
                }
                cov.written += 1;
                let current = c.created("primary").unwrap().map(|(epoch, _)| epoch);
                if current != Some(w.epoch) {
                    return Err(format!(
                        "the write of the primary of epoch {} landed at {now:?}, when the primary's key is of epoch {current:?}: a deposed primary acted",
                        w.epoch
                    ));
                }
            }
            writes.retain(|w| w.arrive > now);
            if now >= next_check {
                // The primary's member check: a member whose key is gone or under a new
                // epoch is dropped under the epoch it was seen with.
                for (k, v) in c.list("nodes/").unwrap() {
                    let j: usize = k[6..].parse().unwrap();
                    let e = LeaseId::from_le_bytes(v.try_into().unwrap());
                    if let Some(old) = seen.insert(j, e).filter(|&old| old != e) {
                        dropped.push((j, old));
                        cov.drops += 1;
                    }
                }
                let live: Vec<usize> = c
                    .list("nodes/")
                    .unwrap()
                    .iter()
                    .map(|(k, _)| k[6..].parse().unwrap())
                    .collect();
                seen.retain(|j, e| {
                    live.contains(j) || {
                        dropped.push((*j, *e));
                        cov.drops += 1;
                        false
                    }
                });
                next_check = now + CHECK;
            }
        }
        // Actors deliver answers and take steps.
        for a in &mut actors {
            if !a.alive || now < a.paused_until {
                continue;
            }
            let answered = a
                .request
                .as_ref()
                .is_some_and(|r| r.answer.is_some() && r.deliver <= now);
            if answered {
                let r = a.request.take().expect("answered");
                match r.answer.unwrap() {
                    Answer::Claimed(Ok(Ok(won))) => {
                        let h = won.held;
                        a.held = Some(h);
                        a.epoch = Some(won.epoch);
                        primaries_seen.push(h.lease);
                        cov.primaries += 1;
                    }
                    Answer::Claimed(_) => {}
                    Answer::Registered(res) => a.held = res.ok(),
                    Answer::Renewed(h, Ok(())) => {
                        a.held = Some(h);
                        cov.renewals += 1;
                    }
                    Answer::Renewed(_, Err(CoordError::Expired(_))) => {
                        a.held = None;
                        a.epoch = None;
                        cov.expired += 1;
                    }
                    Answer::Renewed(_, Err(e)) => return Err(format!("renewal failed: {e}")),
                }
                a.next_step = now + renew_every(TTL);
            } else if a.request.is_none() && a.next_step <= now {
                let d1 = if rng.chance(50) {
                    rng.ms(2 * TTL.as_millis() as u64)
                } else {
                    rng.ms(20)
                };
                let d2 = if rng.chance(50) {
                    rng.ms(2 * TTL.as_millis() as u64)
                } else {
                    rng.ms(20)
                };
                a.request = Some(InFlight {
                    sent: now,
                    arrive: now + d1,
                    deliver: now + d1 + d2,
                    answer: None,
                });
            }
            // A primary's duty (naming its standby, say): decided while it believes itself
            // primary, its write reaching the coordinator soon, or after a pause or a delay
            // longer than a lease.
            if let (true, Some(epoch)) = (a.acts(now), a.epoch) {
                if rng.chance(30) {
                    let late = if rng.chance(100) {
                        rng.ms(3 * TTL.as_millis() as u64)
                    } else {
                        rng.ms(20)
                    };
                    writes.push(PrimaryWrite {
                        arrive: now + late,
                        guard: Guard {
                            key: "primary".into(),
                            lease: a.held.expect("acts").lease,
                        },
                        epoch,
                    });
                }
            }
            // Faults: pauses and kills of the actor (a killed one starts again, empty).
            if rng.chance(3) {
                a.paused_until = now + rng.ms(3 * TTL.as_millis() as u64);
            } else if rng.chance(1) {
                *a = Actor::new(a.kind, now + rng.ms(2 * TTL.as_millis() as u64));
            }
        }
        if now >= coord_paused_until && rng.chance(2) {
            coord_paused_until = now + rng.ms(2 * TTL.as_millis() as u64);
        }
        // The oracle.
        let acting: Vec<&Actor> = actors.iter().filter(|a| a.acts(now)).collect();
        let primaries = acting.iter().filter(|a| a.kind == Kind::Candidate).count();
        if primaries > 1 {
            return Err(format!("{primaries} primaries act at {now:?}"));
        }
        for a in &acting {
            if let Kind::Member(j) = a.kind {
                let e = a.held.unwrap().lease;
                if dropped.contains(&(j, e)) {
                    return Err(format!(
                        "node {j} serves at {now:?} under epoch {e}, after it was dropped"
                    ));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn no_two_primaries_and_no_dropped_node_serves_over_many_seeds() {
    let seeds: u64 = std::env::var("RACKFS_LEASE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let mut cov = Coverage::default();
    for seed in 0..seeds {
        if let Err(e) = run(seed, true, &mut cov) {
            panic!("seed {seed}: {e}");
        }
    }
    eprintln!(
        "{seeds} seeds: {} primaries elected, {} members dropped, {} renewals, {} leases found lapsed, {} primaries' writes landed, {} refused as deposed",
        cov.primaries, cov.drops, cov.renewals, cov.expired, cov.written, cov.refused
    );
    assert!(
        cov.primaries > seeds * 2
            && cov.drops > seeds
            && cov.expired > seeds
            && cov.written > seeds
            && cov.refused > seeds / 10,
        "the runs exercised too little to prove anything"
    );
}

/// The mutation: primaries write with a plain put, as the daemon did before its writes were
/// guarded. The oracle must find a deposed primary's late write within the CI seed count.
#[test]
fn without_the_guard_a_deposed_primary_writes() {
    let mut cov = Coverage::default();
    let found = (0..10_000).find_map(|seed| run(seed, false, &mut cov).err().map(|e| (seed, e)));
    let (seed, e) = found.expect("no seed found a deposed primary's write without the guard");
    eprintln!("without the guard, seed {seed}: {e}");
    assert!(e.contains("deposed"), "{e}");
}
