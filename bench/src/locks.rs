//! Range locks: Citron against a CPU-based lock server and against one mutex per segment, in
//! the same run, on a real memory-node process over shm and tcp.
//!
//! * **Citron**: `rackfs_locks::LockTree`, one queue pair per client thread.
//! * **RPC server**: the memory node's own range-lock table, reached by a blocking control RPC
//!   on the same transport's control path (TCP, or the node's Unix socket for shm): every
//!   lock operation costs the node's CPU — the paper's baseline.
//! * **Segment mutex**: one ticket lock (FAA the ticket, poll the turn) per 64-unit segment,
//!   taken in ascending order — a static partitioning that cannot follow the ranges.
//!
//! Each client thread loops acquire, release over random ranges for the duration; throughput
//! is acquisitions per second over all clients, latency is per acquisition.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rackfs_locks::{Geometry, LockConfig, LockTree};
use rackfs_proto::control::ControlRequest;
use rackfs_proto::ControlClient;
use rackfs_tests::{MemNodeProcess, Rng};
use rackfs_verbs::{block_on, Batch, QueuePair, RemoteAddr};

use crate::stats::{median, micros, percentile, rate};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum System {
    Citron,
    RpcServer,
    SegmentMutex,
}

impl System {
    pub const ALL: [System; 3] = [System::Citron, System::RpcServer, System::SegmentMutex];
    pub fn name(self) -> &'static str {
        match self {
            System::Citron => "Citron",
            System::RpcServer => "RPC lock server",
            System::SegmentMutex => "segment mutex",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pattern {
    /// 64 units aligned to 64 (one leaf, one segment).
    Aligned,
    /// 64 units at any offset.
    Unaligned,
    /// 1 to 1024 units at any offset.
    Variable,
}

impl Pattern {
    pub const ALL: [Pattern; 3] = [Pattern::Aligned, Pattern::Unaligned, Pattern::Variable];
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Aligned => "aligned 64",
            Pattern::Unaligned => "unaligned 64",
            Pattern::Variable => "variable 1-1024",
        }
    }
    fn pick(self, rng: &mut Rng, space: u64) -> (u64, u64) {
        match self {
            Pattern::Aligned => {
                let s = rng.below(space / 64) * 64;
                (s, s + 64)
            }
            Pattern::Unaligned => {
                let s = rng.below(space - 64);
                (s, s + 64)
            }
            Pattern::Variable => {
                let len = 1 + rng.below(1024);
                let s = rng.below(space - len);
                (s, s + len)
            }
        }
    }
}

pub struct Config {
    pub transports: Vec<&'static str>,
    pub clients: Vec<usize>,
    pub patterns: Vec<Pattern>,
    /// Lock spaces in units: large = low contention, small = high contention.
    pub spaces: Vec<u64>,
    pub duration: Duration,
    pub runs: usize,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    pub per_sec: f64,
    pub p50_ns: f64,
    pub p99_ns: f64,
    /// Citron: node acquisitions aborted for a late notification, per acquisition.
    pub abort_rate: f64,
}

pub struct Row {
    pub transport: &'static str,
    pub system: System,
    pub pattern: Pattern,
    pub space: u64,
    pub clients: usize,
    pub sample: Sample,
}

const SEGMENT: u64 = 64;

/// One client's way of locking.
enum Locker {
    Citron(LockTree),
    Rpc(Box<ControlClient>, u64),
    Segments(QueuePair, RemoteAddr),
}

impl Locker {
    fn lock(&self, l: u64, r: u64) -> Box<dyn FnOnce(&Locker) + '_> {
        match self {
            Locker::Citron(t) => {
                let g = block_on(t.acquire(l, r)).expect("citron acquire");
                Box::new(move |me| {
                    if let Locker::Citron(t) = me {
                        block_on(t.release(g)).expect("citron release");
                    }
                })
            }
            Locker::Rpc(c, space) => {
                c.call(&ControlRequest::BaselineRangeLock {
                    space: *space,
                    l,
                    r,
                })
                .expect("rpc lock");
                let space = *space;
                Box::new(move |me| {
                    if let Locker::Rpc(c, _) = me {
                        c.call(&ControlRequest::BaselineRangeUnlock { space, l, r })
                            .expect("rpc unlock");
                    }
                })
            }
            Locker::Segments(qp, base) => {
                let (first, last) = (l / SEGMENT, (r - 1) / SEGMENT);
                for s in first..=last {
                    let next = base.add(s * 16);
                    let ticket = qp.faa(next, 1).expect("ticket");
                    while u64::from_le_bytes(
                        qp.read(next.add(8), 8)
                            .expect("turn")
                            .try_into()
                            .expect("8"),
                    ) != ticket
                    {
                        std::thread::yield_now();
                    }
                }
                Box::new(move |me| {
                    if let Locker::Segments(qp, base) = me {
                        let mut b = Batch::new();
                        for s in first..=last {
                            b.faa(base.add(s * 16 + 8), 1);
                        }
                        qp.execute(b).expect("release").check().expect("release");
                    }
                })
            }
        }
    }
}

fn measure(
    node: &MemNodeProcess,
    transport: &str,
    system: System,
    pattern: Pattern,
    space: u64,
    clients: usize,
    dur: Duration,
) -> Sample {
    let control = node.control();
    let qp = || {
        if transport == "shm" {
            node.shm_qp()
        } else {
            node.tcp_qp()
        }
    };
    let mem_len = match system {
        System::Citron => LockTree::memory_len(Geometry::for_units(space)),
        System::SegmentMutex => space / SEGMENT * 16,
        System::RpcServer => 0,
    };
    let (region, offset) = if mem_len > 0 {
        control.alloc(mem_len, 64).expect("lock memory")
    } else {
        (node.tcp_qp().regions()[0], 0)
    };
    let base = RemoteAddr::new(region.rkey, offset);
    let cfg = {
        let q = qp();
        block_on(LockConfig::calibrated(&q, base)).expect("calibrate")
    };
    let space_id = rand_space();
    let gate = Arc::new(Barrier::new(clients));
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let locker = match system {
                System::Citron => Locker::Citron(LockTree::new(
                    qp(),
                    base,
                    Geometry::for_units(space),
                    cfg.clone(),
                    i as u16,
                )),
                System::RpcServer => Locker::Rpc(
                    Box::new(if transport == "shm" {
                        ControlClient::connect_unix(&node.shm, &node.secret, "bench")
                            .expect("control")
                    } else {
                        ControlClient::connect_tcp(&node.tcp, &node.secret, "bench")
                            .expect("control")
                    }),
                    space_id,
                ),
                System::SegmentMutex => Locker::Segments(qp(), base),
            };
            let gate = gate.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x5eed ^ (i as u64) << 32 ^ space);
                let mut lat = Vec::with_capacity(1 << 16);
                gate.wait();
                let start = Instant::now();
                while start.elapsed() < dur {
                    let (l, r) = pattern.pick(&mut rng, space);
                    let t = Instant::now();
                    let release = locker.lock(l, r);
                    lat.push(t.elapsed().as_nanos() as u64);
                    release(&locker);
                }
                let aborts = if let Locker::Citron(t) = &locker {
                    t.aborts()
                } else {
                    0
                };
                (lat, start.elapsed(), aborts)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut per_sec = 0.0;
    let mut aborts = 0;
    for h in handles {
        let (lat, el, a) = h.join().expect("client thread");
        aborts += a;
        per_sec += lat.len() as f64 / el.as_secs_f64();
        all.extend(lat);
    }
    if mem_len > 0 {
        control.free(offset, None).expect("free lock memory");
    }
    all.sort_unstable();
    Sample {
        per_sec,
        p50_ns: percentile(&all, 50.0) as f64,
        p99_ns: percentile(&all, 99.0) as f64,
        abort_rate: aborts as f64 / all.len().max(1) as f64,
    }
}

fn rand_space() -> u64 {
    let n = rackfs_verbs::auth::nonce();
    u64::from_le_bytes(n[..8].try_into().expect("8"))
}

pub fn run(cfg: &Config) -> Vec<Row> {
    let node = MemNodeProcess::start_with(
        "256M",
        rackfs_verbs::Secret::generate(),
        &["--baseline-lock-server"],
    );
    let mut rows = Vec::new();
    for &transport in &cfg.transports {
        for &space in &cfg.spaces {
            for &pattern in &cfg.patterns {
                for &clients in &cfg.clients {
                    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); 3];
                    for run in 0..cfg.runs {
                        for k in 0..3 {
                            let i = (k + run) % 3;
                            samples[i].push(measure(
                                &node,
                                transport,
                                System::ALL[i],
                                pattern,
                                space,
                                clients,
                                cfg.duration,
                            ));
                        }
                    }
                    for (i, s) in samples.into_iter().enumerate() {
                        let row = Row {
                            transport,
                            system: System::ALL[i],
                            pattern,
                            space,
                            clients,
                            sample: Sample {
                                per_sec: median(&s.iter().map(|x| x.per_sec).collect::<Vec<_>>()),
                                p50_ns: median(&s.iter().map(|x| x.p50_ns).collect::<Vec<_>>()),
                                p99_ns: median(&s.iter().map(|x| x.p99_ns).collect::<Vec<_>>()),
                                abort_rate: median(
                                    &s.iter().map(|x| x.abort_rate).collect::<Vec<_>>(),
                                ),
                            },
                        };
                        eprintln!("{}", format_row(&row));
                        rows.push(row);
                    }
                }
            }
        }
    }
    rows
}

pub fn table_header() -> String {
    "| transport | contention | ranges | clients | system | acquisitions/s | p50 µs | p99 µs | Twait aborts per acquisition |\n|---|---|---|---:|---|---:|---:|---:|---:|".into()
}

fn contention(space: u64) -> String {
    if space >= 1 << 20 {
        format!("low ({space} units)")
    } else {
        format!("high ({space} units)")
    }
}

pub fn format_row(r: &Row) -> String {
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        r.transport,
        contention(r.space),
        r.pattern.name(),
        r.clients,
        r.system.name(),
        rate(r.sample.per_sec),
        micros(r.sample.p50_ns),
        micros(r.sample.p99_ns),
        if r.system == System::Citron {
            format!("{:.2}", r.sample.abort_rate)
        } else {
            "-".into()
        }
    )
}

/// Citron over each baseline at each point with 8 or more clients.
pub fn ratios(rows: &[Row]) -> Vec<String> {
    let mut out = Vec::new();
    for c in rows
        .iter()
        .filter(|r| r.system == System::Citron && r.clients >= 8)
    {
        let find = |s: System| {
            rows.iter().find(|r| {
                r.system == s
                    && r.transport == c.transport
                    && r.space == c.space
                    && r.pattern == c.pattern
                    && r.clients == c.clients
            })
        };
        if let (Some(rpc), Some(seg)) = (find(System::RpcServer), find(System::SegmentMutex)) {
            out.push(format!(
                "{} {} {} {} clients: Citron = {:.2}x the RPC server's throughput (p99 {} vs {} µs), {:.2}x the segment mutex's",
                c.transport,
                contention(c.space),
                c.pattern.name(),
                c.clients,
                c.sample.per_sec / rpc.sample.per_sec,
                micros(c.sample.p99_ns),
                micros(rpc.sample.p99_ns),
                c.sample.per_sec / seg.sample.per_sec
            ));
        }
    }
    out
}
