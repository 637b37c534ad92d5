//! The lock protocol over real verbs, checked by the same oracle as the simulation (no two
//! holders of overlapping ranges, every acquisition completes), on shm and tcp here and on rdma
//! inside the Soft-RoCE guest (`scripts/rdma-guest`), plus, on rdma, a FUSE mount under a fio
//! verify job. Bounded: a fixed number of acquisitions per client and a deadline.

use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use rackfs_locks::{Geometry, LockConfig, LockTree};
use rackfs_tests::{connect, MemNodeProcess, Rng, Via};
use rackfs_verbs::{block_on, RemoteAddr};

/// Held ranges, checked on every grant.
#[derive(Default)]
struct Oracle {
    held: Vec<(usize, u64, u64)>,
    grants: u64,
}

impl Oracle {
    fn grant(&mut self, c: usize, l: u64, r: u64) {
        if let Some(o) = self.held.iter().find(|h| h.1 < r && l < h.2) {
            panic!(
                "overlapping holders: client {c} got [{l}, {r}) while client {} holds [{}, {})",
                o.0, o.1, o.2
            );
        }
        self.held.push((c, l, r));
        self.grants += 1;
    }
    fn release(&mut self, c: usize, l: u64, r: u64) {
        let i = self
            .held
            .iter()
            .position(|h| *h == (c, l, r))
            .expect("released what was held");
        self.held.swap_remove(i);
    }
}

/// `clients` threads, each on its own queue pair, take `rounds` random ranges of a 512-unit
/// space (some of them whole-space) and hold each briefly.
fn oracle_run(via: Via, clients: usize, rounds: usize) {
    let extra: Vec<&str> = match &via {
        Via::Rdma(dev) => vec!["--rdma-device", dev.as_str()],
        _ => vec![],
    };
    let node = MemNodeProcess::start_with("64M", rackfs_verbs::Secret::generate(), &extra);
    let geo = Geometry::for_units(512);
    let (region, offset) = node
        .control()
        .alloc(LockTree::memory_len(geo), 64)
        .expect("lock tree memory");
    let base = RemoteAddr::new(region.rkey, offset);
    let cfg = block_on(LockConfig::calibrated(&connect(&node, &via), base)).expect("calibrate");
    let oracle = Arc::new(Mutex::new(Oracle::default()));
    let gate = Arc::new(Barrier::new(clients));
    let deadline = Instant::now() + Duration::from_secs(120);
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let tree = LockTree::new(connect(&node, &via), base, geo, cfg.clone(), c as u16);
            let (oracle, gate) = (oracle.clone(), gate.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0xc17 + c as u64);
                gate.wait();
                for k in 0..rounds {
                    assert!(Instant::now() < deadline, "client {c} stalled at round {k}");
                    let (l, r) = if rng.below(10) == 0 {
                        (0, 512)
                    } else {
                        let l = rng.below(500);
                        (l, l + 1 + rng.below(12))
                    };
                    let g = block_on(tree.acquire(l, r)).expect("acquire");
                    oracle.lock().unwrap().grant(c, l, r);
                    if rng.below(4) == 0 {
                        std::thread::sleep(Duration::from_micros(rng.below(300)));
                    }
                    oracle.lock().unwrap().release(c, l, r);
                    block_on(tree.release(g)).expect("release");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client");
    }
    let grants = oracle.lock().unwrap().grants;
    assert_eq!(grants, (clients * rounds) as u64);
}

#[test]
fn citron_oracle_over_shm() {
    oracle_run(Via::Shm, 4, 3000);
}

#[test]
fn citron_oracle_over_tcp() {
    oracle_run(Via::Tcp, 4, 1500);
}

#[cfg(feature = "rdma")]
fn rdma_device() -> String {
    std::env::var("RACKFS_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into())
}

#[cfg(feature = "rdma")]
#[test]
fn citron_oracle_over_rdma() {
    oracle_run(Via::Rdma(rdma_device()), 3, 200);
}

/// A FUSE mount whose data path is RDMA: fio writes with checksums and reads them back.
#[cfg(feature = "rdma")]
#[test]
fn fuse_mount_over_rdma_passes_fio_verify() {
    let dev = rdma_device();
    let cluster = rackfs_tests::TestCluster::start_with(1, "64M", &["--rdma-device", &dev]);
    let m = rackfs_tests::Mount::new(&cluster, &format!("transport=rdma,rdma_device={dev}"));
    let report = rackfs_tests::Fio::verify("v", &m.dir, "randwrite", "2M").run();
    assert_eq!(
        report.first().error,
        0,
        "fio verify over rdma failed: {report:?}\nmount log: {}",
        std::fs::read_to_string(&m.log).unwrap_or_default()
    );
    let stats = cluster.control(0).stats().expect("stats");
    assert_eq!(
        stats.open[3], 1,
        "the mount's one rdma queue pair: {stats:?}"
    );
}
