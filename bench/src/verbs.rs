//! Verbs micro-benchmarks: each transport against its limit, measured in the same run.
//!
//! * `shm` against the same operations done with plain loads, stores, memcpy and atomics on
//!   local memory (what a colocated client could do at best).
//! * `tcp` against a bare TCP loopback ping-pong that sends and receives frames of exactly the
//!   sizes the tcp transport puts on the wire for the same batch (what any TCP protocol could
//!   do at best on this host).
//!
//! Every point is measured `runs` times, alternating the system and its baseline, and the
//! median is reported; latency is per batch (one round trip).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::AsRawFd;

use rackfs_tests::MemNodeProcess;
use rackfs_verbs::tcp::{poll_readable, DEFAULT_POLL};
use rackfs_verbs::{Access, Batch, QueuePair, Region, RemoteAddr};

use crate::stats::{median, micros, percentile, rate};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    Cas,
    Faa,
    Read(u32),
    Write(u32),
}

impl Op {
    fn name(self) -> String {
        match self {
            Op::Cas => "CAS 8B".into(),
            Op::Faa => "FAA 8B".into(),
            Op::Read(n) => format!("READ {}K", n / 1024),
            Op::Write(n) => format!("WRITE {}K", n / 1024),
        }
    }
    fn size(self) -> u64 {
        match self {
            Op::Read(n) | Op::Write(n) => n as u64,
            _ => 8,
        }
    }
    /// Bytes of one request and one response on the tcp wire, for a batch of `n`.
    fn wire_sizes(self, n: usize) -> (usize, usize) {
        let per_req = 13
            + match self {
                Op::Cas => 16,
                Op::Faa => 8,
                Op::Read(_) => 4,
                Op::Write(len) => 4 + len as usize,
            };
        let read = if let Op::Read(len) = self {
            len as usize
        } else {
            0
        };
        (8 + 10 + n * per_req, 8 + 10 + n * (9 + read))
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub ops_per_sec: f64,
    pub p50_ns: f64,
    pub p99_ns: f64,
}

/// Runs `threads` workers for `dur`; each calls its step (one batch of `batch` ops) in a loop.
fn measure<S: FnMut() + Send + 'static>(dur: Duration, batch: usize, steps: Vec<S>) -> Sample {
    let start_gate = Arc::new(std::sync::Barrier::new(steps.len()));
    let handles: Vec<_> = steps
        .into_iter()
        .map(|mut step| {
            let gate = start_gate.clone();
            std::thread::spawn(move || {
                let mut lat = Vec::with_capacity(1 << 16);
                step(); // warm up
                gate.wait();
                let start = Instant::now();
                let end = start + dur;
                loop {
                    let t = Instant::now();
                    if t >= end {
                        break;
                    }
                    step();
                    lat.push(t.elapsed().as_nanos() as u64);
                }
                (lat, start.elapsed())
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut ops = 0.0;
    for h in handles {
        let (lat, el) = h.join().expect("bench worker");
        ops += (lat.len() * batch) as f64 / el.as_secs_f64();
        all.extend(lat);
    }
    all.sort_unstable();
    Sample {
        ops_per_sec: ops,
        p50_ns: percentile(&all, 50.0) as f64,
        p99_ns: percentile(&all, 99.0) as f64,
    }
}

/// Per-thread slice of the region: 4 MiB apart, so threads do not contend.
fn base(thread: usize) -> u64 {
    thread as u64 * (4 << 20)
}

fn qp_step(qp: QueuePair, rkey: u32, op: Op, batch: usize, thread: usize) -> impl FnMut() + Send {
    let payload = vec![0xABu8; op.size() as usize];
    let mut round = 0u64;
    move || {
        let mut b = Batch::with_capacity(batch);
        for i in 0..batch {
            let a = RemoteAddr::new(rkey, base(thread) + i as u64 * op.size().max(64));
            match op {
                Op::Cas => b.cas(a, round, round + 1),
                Op::Faa => b.faa(a, 1),
                Op::Read(n) => b.read(a, n),
                Op::Write(_) => b.write(a, &payload),
            };
        }
        round += 1;
        qp.execute(b).expect("batch").check().expect("ops");
    }
}

fn local_step(mem: Arc<Region>, op: Op, batch: usize, thread: usize) -> impl FnMut() + Send {
    let payload = vec![0xABu8; op.size() as usize];
    let mut buf = vec![0u8; op.size() as usize];
    let mut round = 0u64;
    move || {
        for i in 0..batch {
            let off = base(thread) + i as u64 * op.size().max(64);
            let a = RemoteAddr::new(1, off);
            let mut sink = rackfs_verbs::Completions::default();
            match op {
                // Atomics through the region's own atomic path (a CPU atomic on local memory).
                Op::Cas => {
                    let wr = rackfs_verbs::WorkRequest::Cas {
                        addr: a,
                        compare: round,
                        swap: round + 1,
                    };
                    mem.execute(&wr, &mut sink).expect("cas");
                }
                Op::Faa => {
                    let wr = rackfs_verbs::WorkRequest::Faa { addr: a, add: 1 };
                    mem.execute(&wr, &mut sink).expect("faa");
                }
                Op::Read(_) => mem.read(off, &mut buf).expect("read"),
                Op::Write(_) => mem.write(off, &payload).expect("write"),
            }
        }
        round += 1;
        std::hint::black_box(&buf);
    }
}

/// A bare TCP server answering each request frame with a response of the announced size. It
/// polls before blocking exactly as the tcp transport does, so the comparison isolates the
/// protocol's own cost.
fn pingpong_server() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                let mut head = [0u8; 8];
                let mut req = Vec::new();
                let mut resp = Vec::new();
                let fd = s.as_raw_fd();
                loop {
                    let _ = poll_readable(fd, DEFAULT_POLL);
                    if s.read_exact(&mut head).is_err() {
                        break;
                    }
                    let req_len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
                    let resp_len = u32::from_le_bytes(head[4..].try_into().unwrap()) as usize;
                    req.resize(req_len - 8, 0);
                    if s.read_exact(&mut req).is_err() {
                        break;
                    }
                    resp.resize(resp_len, 0);
                    if s.write_all(&resp).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

fn pingpong_step(addr: &str, op: Op, batch: usize) -> impl FnMut() + Send {
    let mut s = TcpStream::connect(addr).expect("connect ping-pong");
    s.set_nodelay(true).expect("nodelay");
    let (req_len, resp_len) = op.wire_sizes(batch);
    let mut req = vec![0u8; req_len];
    req[..4].copy_from_slice(&(req_len as u32).to_le_bytes());
    req[4..8].copy_from_slice(&(resp_len as u32).to_le_bytes());
    let mut resp = vec![0u8; resp_len];
    let fd = s.as_raw_fd();
    move || {
        s.write_all(&req).expect("send");
        let _ = poll_readable(fd, DEFAULT_POLL);
        s.read_exact(&mut resp).expect("receive");
    }
}

pub struct Row {
    pub transport: &'static str,
    pub op: Op,
    pub batch: usize,
    pub threads: usize,
    pub system: Sample,
    pub baseline: Sample,
}

pub struct Config {
    pub duration: Duration,
    pub runs: usize,
    pub transports: Vec<String>,
    pub ops: Vec<Op>,
    pub batches: Vec<usize>,
    pub threads: Vec<usize>,
}

fn med(samples: &[Sample]) -> Sample {
    Sample {
        ops_per_sec: median(&samples.iter().map(|s| s.ops_per_sec).collect::<Vec<_>>()),
        p50_ns: median(&samples.iter().map(|s| s.p50_ns).collect::<Vec<_>>()),
        p99_ns: median(&samples.iter().map(|s| s.p99_ns).collect::<Vec<_>>()),
    }
}

pub fn run(cfg: &Config) -> Vec<Row> {
    let node = MemNodeProcess::start("64M");
    let local = Arc::new(Region::heap(64 << 20, 1, Access::ALL));
    let pp = pingpong_server();
    let mut rows = Vec::new();
    for transport in ["shm", "tcp"] {
        if !cfg.transports.iter().any(|t| t == transport) {
            continue;
        }
        for &op in &cfg.ops {
            for &batch in &cfg.batches {
                for &threads in &cfg.threads {
                    let mut sys = Vec::new();
                    let mut base_s = Vec::new();
                    for run in 0..cfg.runs {
                        let system = || {
                            let steps: Vec<_> = (0..threads)
                                .map(|t| {
                                    let qp = if transport == "shm" {
                                        node.shm_qp()
                                    } else {
                                        node.tcp_qp()
                                    };
                                    let rkey = qp.regions()[0].rkey;
                                    Box::new(qp_step(qp, rkey, op, batch, t))
                                        as Box<dyn FnMut() + Send>
                                })
                                .collect();
                            measure(cfg.duration, batch, steps)
                        };
                        let baseline = || {
                            let steps: Vec<_> = (0..threads)
                                .map(|t| {
                                    if transport == "shm" {
                                        Box::new(local_step(local.clone(), op, batch, t))
                                            as Box<dyn FnMut() + Send>
                                    } else {
                                        Box::new(pingpong_step(&pp, op, batch))
                                            as Box<dyn FnMut() + Send>
                                    }
                                })
                                .collect();
                            measure(cfg.duration, batch, steps)
                        };
                        // Alternate which goes first, so drift in machine load hits both.
                        if run % 2 == 0 {
                            sys.push(system());
                            base_s.push(baseline());
                        } else {
                            base_s.push(baseline());
                            sys.push(system());
                        }
                    }
                    let row = Row {
                        transport,
                        op,
                        batch,
                        threads,
                        system: med(&sys),
                        baseline: med(&base_s),
                    };
                    eprintln!("{}", format_row(&row));
                    rows.push(row);
                }
            }
        }
    }
    rows
}

pub fn table_header() -> String {
    "| transport | op | batch | threads | ops/s | p50 µs | p99 µs | baseline ops/s | baseline p50 µs | ratio |\n\
     |---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        .into()
}

pub fn format_row(r: &Row) -> String {
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0}% |",
        r.transport,
        r.op.name(),
        r.batch,
        r.threads,
        rate(r.system.ops_per_sec),
        micros(r.system.p50_ns),
        micros(r.system.p99_ns),
        rate(r.baseline.ops_per_sec),
        micros(r.baseline.p50_ns),
        100.0 * r.system.ops_per_sec / r.baseline.ops_per_sec
    )
}

/// The batching gain on tcp: ops/s with batch 32 over batch 1, per op and thread count.
pub fn batching_gains(rows: &[Row]) -> Vec<String> {
    let mut out = Vec::new();
    for r32 in rows
        .iter()
        .filter(|r| r.transport == "tcp" && r.batch == 32)
    {
        if let Some(r1) = rows.iter().find(|r| {
            r.transport == "tcp" && r.batch == 1 && r.op == r32.op && r.threads == r32.threads
        }) {
            out.push(format!(
                "tcp {} with {} thread(s): batch 32 = {:.1}x the ops/s of batch 1",
                r32.op.name(),
                r32.threads,
                r32.system.ops_per_sec / r1.system.ops_per_sec
            ));
        }
    }
    out
}
