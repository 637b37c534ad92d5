//! One environment trait under which the verbs conformance cases run on every transport: real
//! memory nodes over shm, tcp or rdma, and the deterministic simulator.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use rackfs_verbs::sim::{Sim, SimConfig, SIM_RKEY, SIM_RO_RKEY};
use rackfs_verbs::{block_on, QueuePair, RegionInfo, Secret};

use crate::node::MemNodeProcess;

/// Where a conformance case runs: how to get queue pairs and how to drive async bodies.
pub trait Env {
    fn name(&self) -> &'static str;
    fn qp(&mut self) -> QueuePair;
    /// The read-write data region and a read-only region.
    fn data_region(&self) -> RegionInfo;
    fn ro_region(&self) -> RegionInfo;
    /// Runs one async body to completion.
    fn run<T: 'static, F: Future<Output = T> + 'static>(&mut self, f: F) -> T;
    /// Runs `n` workers, each on its own queue pair, concurrently, to completion.
    fn run_parallel<F, Fut>(&mut self, n: usize, f: F)
    where
        F: Fn(usize, QueuePair) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static;
}

fn region_by(qp: &QueuePair, want_write: bool) -> RegionInfo {
    *qp.regions()
        .iter()
        .find(|r| r.access.contains(rackfs_verbs::Access::WRITE) == want_write)
        .expect("region of the wanted kind")
}

/// How a test reaches a real memory node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Via {
    Shm,
    Tcp,
    /// RC queue pairs on this RDMA device (the node serves it with `--rdma-device`).
    Rdma(String),
}

/// A real memory node reached over `shm`, `tcp` or `rdma`.
pub struct NodeEnv {
    pub node: MemNodeProcess,
    pub via: Via,
    data: RegionInfo,
    ro: RegionInfo,
}

impl NodeEnv {
    pub fn new(shm: bool) -> NodeEnv {
        Self::over(if shm { Via::Shm } else { Via::Tcp })
    }

    pub fn over(via: Via) -> NodeEnv {
        let node = match &via {
            Via::Rdma(dev) => {
                MemNodeProcess::start_with("16M", Secret::generate(), &["--rdma-device", dev])
            }
            _ => MemNodeProcess::start("16M"),
        };
        let qp = connect(&node, &via);
        NodeEnv {
            data: region_by(&qp, true),
            ro: region_by(&qp, false),
            node,
            via,
        }
    }
}

/// A queue pair to `node` over `via`.
pub fn connect(node: &MemNodeProcess, via: &Via) -> QueuePair {
    match via {
        Via::Shm => node.shm_qp(),
        Via::Tcp => node.tcp_qp(),
        Via::Rdma(dev) => {
            rackfs_verbs::rdma::connect(&node.tcp, &node.secret, "test", 0, Some(dev))
                .unwrap_or_else(|e| panic!("rdma connect: {e}; node log: {}", node.stderr()))
        }
    }
}

impl Env for NodeEnv {
    fn name(&self) -> &'static str {
        match self.via {
            Via::Shm => "shm",
            Via::Tcp => "tcp",
            Via::Rdma(_) => "rdma",
        }
    }
    fn qp(&mut self) -> QueuePair {
        connect(&self.node, &self.via)
    }
    fn data_region(&self) -> RegionInfo {
        self.data
    }
    fn ro_region(&self) -> RegionInfo {
        self.ro
    }
    fn run<T: 'static, F: Future<Output = T> + 'static>(&mut self, f: F) -> T {
        block_on(f)
    }
    fn run_parallel<F, Fut>(&mut self, n: usize, f: F)
    where
        F: Fn(usize, QueuePair) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let f = std::sync::Arc::new(f);
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let qp = self.qp();
                let f = f.clone();
                std::thread::spawn(move || block_on(f(i, qp)))
            })
            .collect();
        for h in handles {
            h.join().expect("worker thread");
        }
    }
}

/// The deterministic simulator.
pub struct SimEnv {
    pub sim: Sim,
}

impl SimEnv {
    pub fn new(seed: u64) -> SimEnv {
        SimEnv {
            sim: Sim::new(SimConfig {
                seed,
                region_len: 16 << 20,
                ..SimConfig::default()
            }),
        }
    }
}

impl Env for SimEnv {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn qp(&mut self) -> QueuePair {
        let c = self.sim.add_client();
        self.sim.handle().connect(c)
    }
    fn data_region(&self) -> RegionInfo {
        RegionInfo {
            rkey: SIM_RKEY,
            len: 16 << 20,
            access: rackfs_verbs::Access::ALL,
        }
    }
    fn ro_region(&self) -> RegionInfo {
        RegionInfo {
            rkey: SIM_RO_RKEY,
            len: 4096,
            access: rackfs_verbs::Access::READ,
        }
    }
    fn run<T: 'static, F: Future<Output = T> + 'static>(&mut self, f: F) -> T {
        let out = Rc::new(RefCell::new(None));
        let o = out.clone();
        let c = self.sim.add_client();
        self.sim.spawn(c, async move {
            *o.borrow_mut() = Some(f.await);
        });
        let outcome = self.sim.run(Duration::from_secs(3600));
        assert_eq!(outcome, rackfs_verbs::sim::RunOutcome::Finished);
        let v = out.borrow_mut().take();
        v.expect("task finished")
    }
    fn run_parallel<F, Fut>(&mut self, n: usize, f: F)
    where
        F: Fn(usize, QueuePair) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        for i in 0..n {
            let c = self.sim.add_client();
            let qp = self.sim.handle().connect(c);
            self.sim.spawn(c, f(i, qp));
        }
        let outcome = self.sim.run(Duration::from_secs(3600));
        assert_eq!(outcome, rackfs_verbs::sim::RunOutcome::Finished);
    }
}
