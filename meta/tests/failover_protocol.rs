//! The metadata failover protocol under simulation, over many seeds: the real metadata
//! service and journal ([`MetaService`], [`journal::replay`]), the real embedded coordinator
//! on a simulated clock ([`Local`]) and the real lease rules ([`claim`], [`renew`], [`Held`]),
//! with the standby's rules as `rackfs-memnode`'s `standby` module states them:
//!
//! * the primary acts (answers) only while its lease holds, timed from each renewal's sending;
//! * it ships each change's journal entries to its standby and answers once the standby took
//!   them; when the standby does not answer within half a lease it deletes the `standby` key
//!   first, then answers (if its lease still holds);
//! * a data node with a mirror campaigns once the `primary` key is gone and `standby` names it,
//!   and, elected, serves its mirror only if `standby` still names it.
//!
//! Three nodes; one client creates and removes files through whoever is primary. Faults:
//! message delays (some longer than a lease), pauses of up to two and a half leases, and kills
//! (a killed node comes back empty, as a data node). The oracle, at every step:
//!
//! * no two primaries act at once;
//! * a primary that took over holds every change that was answered: each file whose creation
//!   was answered (and whose removal was not) is there, each whose removal was answered is
//!   not. Changes whose answer was lost are left out.
//!
//! Simplifications: coordinator calls other than lease renewals and claims take no time; a
//! snapshot reaches a standby at once (the sync happens only while the node is up).
//! `RACKFS_FAILOVER_SEEDS=N` runs more seeds (default 10,000).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::{Clock, ManualClock};
use rackfs_coord::{claim, renew, renew_every, Coordinator, Held, Local};
use rackfs_meta::{journal, Entry, MemStorage, MetaService, Namespace, Storage};
use rackfs_proto::control::ControlResponse;
use rackfs_proto::namespace::{MetaRequest, NewKind, ROOT_INO};

const TTL: Duration = Duration::from_millis(1000);
const TICK: Duration = Duration::from_millis(5);
const RUN: Duration = Duration::from_secs(12);
const NODES: usize = 3;
/// How long the primary waits for its standby's answer (half a lease, as the daemon).
const SHIP_WAIT: Duration = Duration::from_millis(500);

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
    /// A message delay: mostly short, sometimes longer than a lease.
    fn delay(&mut self) -> Duration {
        if self.chance(20) {
            Duration::from_millis(self.below(2 * TTL.as_millis() as u64))
        } else {
            Duration::from_millis(self.below(30))
        }
    }
}

/// A change the client waits for: a file created or removed.
#[derive(Clone)]
struct Change {
    name: Vec<u8>,
    create: bool,
}

/// The primary's change in flight: waiting for its standby.
struct Pending {
    change: Change,
    /// Give up on the standby then.
    deadline: Duration,
    /// The journal position the standby must reach.
    seq: u64,
    /// When the standby's answer arrives, once it sent one.
    answered_at: Option<Duration>,
}

enum Role {
    Data {
        /// The mirror: namespace, journal position, and the primary incarnation it follows.
        mirror: Option<(Namespace, u64, u64)>,
        next_watch: Duration,
    },
    Primary {
        svc: Box<MetaService>,
        lease: Held,
        /// A renewal on its way: sent, processed by the coordinator at, its answer back at.
        renewal: Option<(Duration, Duration, Duration)>,
        next_renew: Duration,
        follower: Option<usize>,
        pending: Option<Pending>,
        next_op: Duration,
    },
}

struct Node {
    id: usize,
    up: bool,
    paused_until: Duration,
    back_at: Duration,
    st: MemStorage,
    role: Role,
    /// Journal entries on their way to this node: (arrival, from primary incarnation, entries).
    inbox: VecDeque<(Duration, u64, Vec<Entry>)>,
    /// Counts this node's lives, so an answer to an earlier one is ignored.
    life: u64,
}

impl Node {
    fn fresh(id: usize, now: Duration, life: u64) -> Node {
        Node {
            id,
            up: true,
            paused_until: Duration::ZERO,
            back_at: Duration::ZERO,
            st: MemStorage::new(1, 1 << 24),
            role: Role::Data {
                mirror: None,
                next_watch: now,
            },
            inbox: VecDeque::new(),
            life,
        }
    }

    fn runs(&self, now: Duration) -> bool {
        self.up && now >= self.paused_until
    }
}

#[derive(Default)]
struct Coverage {
    takeovers: u64,
    answered: u64,
    dropped_standbys: u64,
    refused_takeovers: u64,
}

fn exists(ns: &mut Namespace, st: &MemStorage, name: &[u8]) -> bool {
    let req = MetaRequest::Lookup {
        parent: ROOT_INO,
        name: name.to_vec(),
    };
    matches!(ns.handle(0, req, st), ControlResponse::Attr(_))
}

macro_rules! trace {
    ($($t:tt)*) => {
        if std::env::var("RACKFS_FAILOVER_TRACE").is_ok() {
            eprintln!($($t)*);
        }
    };
}

fn run(seed: u64, cov: &mut Coverage) -> Result<(), String> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let clock = Arc::new(ManualClock::default());
    let c = Local::with_clock(TTL / 4, clock.clone());
    let mut nodes: Vec<Node> = (0..NODES)
        .map(|i| Node::fresh(i, Duration::ZERO, 0))
        .collect();
    // Node 0 starts as the primary.
    {
        let Ok(Ok(won)) = claim(&c, "primary", b"0", TTL, Duration::ZERO) else {
            return Err("the first claim failed".into());
        };
        let lease = won.held;
        let st = &nodes[0].st;
        nodes[0].role = Role::Primary {
            svc: Box::new(MetaService::new(Duration::from_secs(2), st.wall_ns())),
            lease,
            renewal: None,
            next_renew: renew_every(TTL),
            follower: None,
            pending: None,
            next_op: Duration::ZERO,
        };
    }
    // What the client was told: name -> exists (answered changes only).
    let mut told: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
    // Names with a change not answered (in flight, or its answer lost): left out of the oracle.
    let mut unknown: Vec<Vec<u8>> = Vec::new();
    let mut serial = 0u64;
    let mut now = Duration::ZERO;
    while now < RUN {
        now += TICK;
        clock.advance(now.saturating_sub(clock.now()));
        // Faults.
        if rng.chance(3) {
            let i = rng.below(NODES as u64) as usize;
            let for_ = Duration::from_millis(rng.below(5 * TTL.as_millis() as u64 / 2));
            nodes[i].paused_until = nodes[i].paused_until.max(now + for_);
            trace!("{now:?} pause {i} until {:?}", nodes[i].paused_until);
        }
        if rng.chance(1) {
            let i = rng.below(NODES as u64) as usize;
            if nodes[i].up {
                nodes[i].up = false;
                nodes[i].back_at =
                    now + Duration::from_millis(rng.below(2 * TTL.as_millis() as u64));
                trace!("{now:?} kill {i}");
            }
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            if !n.up && now >= n.back_at {
                let life = n.life + 1;
                *n = Node::fresh(i, now, life);
            }
        }
        // Journal entries reach running standbys.
        for i in 0..NODES {
            if !nodes[i].runs(now) {
                continue;
            }
            while nodes[i].inbox.front().is_some_and(|m| m.0 <= now) {
                let (_, from, entries) = nodes[i].inbox.pop_front().expect("front");
                trace!("{now:?} {i} receives {} entries from {from}", entries.len());
                let node = &mut nodes[i];
                let (st, role) = (&node.st, &mut node.role);
                let Role::Data {
                    mirror: Some((ns, seq, of)),
                    ..
                } = role
                else {
                    continue;
                };
                if from != *of {
                    continue; // another primary's (an earlier one's, late)
                }
                let mut ok = true;
                for e in entries {
                    if e.seq <= *seq {
                        continue; // in the snapshot already
                    }
                    if e.seq != *seq + 1 || journal::replay(ns, st.local().1, e.clone()).is_err() {
                        ok = false;
                        break;
                    }
                    *seq = e.seq;
                }
                let reached = *seq;
                if !ok {
                    *role = Role::Data {
                        mirror: None,
                        next_watch: now,
                    };
                    continue;
                }
                // The answer goes back to the primary's incarnation `from`.
                let back = now + rng.delay();
                for p in nodes
                    .iter_mut()
                    .filter(|p| p.life == from >> 8 && p.id as u64 == from & 0xff)
                {
                    if let Role::Primary {
                        pending: Some(pend),
                        ..
                    } = &mut p.role
                    {
                        if reached >= pend.seq && pend.answered_at.is_none() {
                            pend.answered_at = Some(back);
                        }
                    }
                }
            }
        }
        // Primaries.
        for i in 0..NODES {
            if !nodes[i].runs(now) {
                continue;
            }
            let me = (nodes[i].life << 8) | i as u64;
            let mut step_down = false;
            let mut ship: Option<(usize, Vec<Entry>)> = None;
            let mut sync_to: Option<usize> = None;
            let candidates: Vec<usize> = (0..NODES)
                .filter(|&j| {
                    j != i && nodes[j].runs(now) && matches!(nodes[j].role, Role::Data { .. })
                })
                .collect();
            {
                let node = &mut nodes[i];
                let st = &node.st;
                let Role::Primary {
                    svc,
                    lease,
                    renewal,
                    next_renew,
                    follower,
                    pending,
                    next_op,
                } = &mut node.role
                else {
                    continue;
                };
                // The change in flight, answered by the thread that made it: it knows its
                // lease only by looking (the daemon's `serve.valid()`), not by the renewals.
                if let Some(p) = pending {
                    let answered = p.answered_at.is_some_and(|t| t <= now);
                    if answered || now >= p.deadline {
                        if !answered {
                            let _ = c.delete("standby");
                            *follower = None;
                            svc.set_journaling(false);
                            cov.dropped_standbys += 1;
                        }
                        let ch = pending.take().expect("pending").change;
                        trace!(
                            "{now:?} {i} resolves {} answered={answered} valid={}",
                            String::from_utf8_lossy(&ch.name),
                            lease.valid(now)
                        );
                        if lease.valid(now) {
                            unknown.retain(|n| *n != ch.name);
                            told.insert(ch.name, ch.create);
                            cov.answered += 1;
                        }
                    }
                }
                // Lease renewals, with delays.
                if renewal.is_none() && now >= *next_renew {
                    let arrive = now + rng.delay();
                    *renewal = Some((now, arrive, arrive + rng.delay()));
                    *next_renew = now + renew_every(TTL);
                }
                if let Some((sent, _, back)) = *renewal {
                    if now >= back {
                        // Processed now (the coordinator's clock is past its arrival).
                        let mut h = *lease;
                        match renew(&c, &mut h, sent) {
                            Ok(()) => *lease = h,
                            Err(_) => step_down = true,
                        }
                        *renewal = None;
                    }
                }
                if !lease.valid(now) {
                    step_down = true;
                }
                if !step_down && pending.is_none() {
                    if now >= *next_op {
                        // The client's next change.
                        let existing: Vec<&Vec<u8>> = told
                            .iter()
                            .filter(|(n, &e)| e && !unknown.contains(n))
                            .map(|(n, _)| n)
                            .collect();
                        let change = if !existing.is_empty() && rng.chance(300) {
                            let k = rng.below(existing.len() as u64) as usize;
                            Change {
                                name: existing[k].clone(),
                                create: false,
                            }
                        } else {
                            serial += 1;
                            Change {
                                name: format!("f{serial}").into_bytes(),
                                create: true,
                            }
                        };
                        let req = if change.create {
                            MetaRequest::Create {
                                parent: ROOT_INO,
                                name: change.name.clone(),
                                kind: NewKind::File {
                                    stripe_unit: 4096,
                                    replicas: 1,
                                },
                                perm: 0o644,
                                uid: 0,
                                gid: 0,
                            }
                        } else {
                            MetaRequest::Unlink {
                                parent: ROOT_INO,
                                name: change.name.clone(),
                                release: None,
                            }
                        };
                        unknown.push(change.name.clone());
                        let resp = svc.handle(1, req, st);
                        if let ControlResponse::Error { message, .. } = resp {
                            return Err(format!("{now:?}: the change failed: {message}"));
                        }
                        let entries = svc.take_journal();
                        match *follower {
                            Some(f) => {
                                let seq = entries.last().map_or(0, |e| e.seq);
                                ship = Some((f, entries));
                                *pending = Some(Pending {
                                    change,
                                    deadline: now + SHIP_WAIT,
                                    seq,
                                    answered_at: None,
                                });
                            }
                            None if lease.valid(now) => {
                                trace!(
                                    "{now:?} {i} answers {} alone",
                                    String::from_utf8_lossy(&change.name)
                                );
                                unknown.retain(|n| *n != change.name);
                                told.insert(change.name, change.create);
                                cov.answered += 1;
                            }
                            None => {}
                        }
                        *next_op = now + Duration::from_millis(rng.below(20));
                    }
                    if follower.is_none() && pending.is_none() && !candidates.is_empty() {
                        sync_to = Some(candidates[rng.below(candidates.len() as u64) as usize]);
                    }
                }
            }
            if step_down {
                trace!("{now:?} {i} steps down");
                // A primary that lost its lease stops (the daemon exits); it comes back empty.
                nodes[i].up = false;
                nodes[i].back_at = now + TTL;
                continue;
            }
            if let Some((f, entries)) = ship {
                let at = now + rng.delay();
                nodes[f].inbox.push_back((at, me, entries));
            }
            if let Some(j) = sync_to {
                // The snapshot (namespace and metadata bytes), then the standby key.
                let Role::Primary { svc, .. } = &mut nodes[i].role else {
                    unreachable!()
                };
                let seq = svc.set_journaling(true);
                let bytes = postcard::to_allocvec(&svc.namespace).expect("encode");
                let extents = svc.namespace.meta_extents();
                let mut copies = Vec::new();
                for (at, len) in extents {
                    let mut b = vec![0; len as usize];
                    nodes[i].st.local().1.read(at, &mut b).expect("extent");
                    copies.push((at, b));
                }
                let ns: Namespace = postcard::from_bytes(&bytes).expect("decode");
                let target = &mut nodes[j];
                target.st.local().1.discard(0, 1 << 24).expect("region");
                for (at, b) in copies {
                    target.st.local().1.write(at, &b).expect("extent");
                }
                target.inbox.clear();
                target.role = Role::Data {
                    mirror: Some((ns, seq, me)),
                    next_watch: now,
                };
                c.put("standby", j.to_string().as_bytes(), None)
                    .map_err(|e| e.to_string())?;
                let Role::Primary { follower, .. } = &mut nodes[i].role else {
                    unreachable!()
                };
                *follower = Some(j);
                trace!("{now:?} {i} synced standby {j} at seq {seq}");
            }
        }
        // Standbys watch the keys and take over.
        for (i, node) in nodes.iter_mut().enumerate() {
            if !node.runs(now) {
                continue;
            }
            let Role::Data {
                mirror: Some(_),
                next_watch,
            } = &mut node.role
            else {
                continue;
            };
            if now < *next_watch {
                continue;
            }
            *next_watch = now + renew_every(TTL);
            let named = |c: &Local| {
                c.get("standby")
                    .ok()
                    .flatten()
                    .is_some_and(|v| v == i.to_string().as_bytes())
            };
            if !matches!(c.get("primary"), Ok(None)) || !named(&c) {
                continue;
            }
            let sent = now;
            let Ok(Ok(won)) = claim(&c, "primary", i.to_string().as_bytes(), TTL, sent) else {
                continue;
            };
            let lease = won.held;
            if !named(&c) {
                cov.refused_takeovers += 1;
                let _ = c.revoke(lease.lease);
                continue;
            }
            let _ = c.delete("standby");
            let Role::Data {
                mirror: Some((mut ns, seq, _)),
                ..
            } = std::mem::replace(
                &mut node.role,
                Role::Data {
                    mirror: None,
                    next_watch: now,
                },
            )
            else {
                unreachable!()
            };
            // The oracle: every answered change is in the mirror.
            let st = &node.st;
            for (name, &present) in &told {
                if unknown.contains(name) {
                    continue;
                }
                if exists(&mut ns, st, name) != present {
                    let dir = ns.handle(
                        0,
                        MetaRequest::ReadDir {
                            ino: ROOT_INO,
                            after: 0,
                            max: 1000,
                        },
                        st,
                    );
                    let look = ns.handle(
                        0,
                        MetaRequest::Lookup {
                            parent: ROOT_INO,
                            name: name.clone(),
                        },
                        st,
                    );
                    trace!("root: {dir:?}\nlookup: {look:?}");
                    return Err(format!(
                        "{now:?}: node {i} took over without {} of {} (answered {})",
                        if present {
                            "the creation"
                        } else {
                            "the removal"
                        },
                        String::from_utf8_lossy(name),
                        if present { "created" } else { "removed" },
                    ));
                }
            }
            let end = ns
                .meta_extents()
                .iter()
                .map(|(at, len)| at + len)
                .max()
                .unwrap_or(0);
            st.reserve_below(0, end);
            cov.takeovers += 1;
            trace!("{now:?} {i} took over at seq {seq}");
            node.role = Role::Primary {
                svc: Box::new(MetaService::over(ns, Duration::from_secs(2), seq)),
                lease,
                renewal: None,
                next_renew: now + renew_every(TTL),
                follower: None,
                pending: None,
                next_op: now,
            };
        }
        // No two primaries act at once.
        let acting: Vec<usize> = nodes
            .iter()
            .filter(|n| n.runs(now))
            .filter(|n| matches!(&n.role, Role::Primary { lease, .. } if lease.valid(now)))
            .map(|n| n.id)
            .collect();
        if acting.len() > 1 {
            return Err(format!("{now:?}: nodes {acting:?} act as primary at once"));
        }
    }
    Ok(())
}

#[test]
fn answered_changes_survive_the_primary_and_one_primary_acts_at_a_time() {
    let seeds: u64 = std::env::var("RACKFS_FAILOVER_SEEDS")
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
        "{seeds} seeds: {} take-overs ({} refused: the standby was dropped), {} changes answered, {} standbys dropped",
        cov.takeovers, cov.refused_takeovers, cov.answered, cov.dropped_standbys
    );
    assert!(
        cov.takeovers > seeds / 2,
        "the faults rarely led to a take-over"
    );
}
