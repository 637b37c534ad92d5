//! What a token check costs: a mount's QoS engine admitting one token at a time (and dropping
//! the admission at once) against a real memory node over shm, next to the same loop without
//! the engine. The node's capacity is set far above the loop's rate, so no admission waits:
//! this is the engine's own cost per data operation.

use std::time::{Duration, Instant};

use rackfs_proto::control::{ControlRequest, ControlResponse};
use rackfs_qos::{EngineConfig, QosEngine};
use rackfs_tests::TestCluster;
use rackfs_verbs::{block_on, RemoteAddr};

use crate::stats::median;

pub fn run(runs: usize, duration: Duration) -> String {
    let c = TestCluster::start_with(1, "64M", &["--qos-capacity", "1000000000"]);
    let node = c.nodes[0].as_ref().expect("node");
    let control = node.control();
    let slot = match control.call(&ControlRequest::QosSet {
        slot: None,
        reservation: 0,
        limit: 0,
        weight: 1,
    }) {
        Ok(ControlResponse::QosGranted { slot, .. }) => slot,
        other => panic!("QoS registration: {other:?}"),
    };
    let area = control.cluster().expect("cluster").nodes[0].qos_area;
    let qp = node.shm_qp();
    let rkey = qp.regions()[0].rkey;
    let engine = QosEngine::new(
        qp.clone(),
        RemoteAddr::new(rkey, area),
        slot,
        EngineConfig::default(),
    );
    // Let the monitor see the mount and start handing out tokens.
    let warm = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < warm {
        drop(block_on(engine.admit(1)).expect("admit"));
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let (mut n, start) = (0u64, Instant::now());
        while start.elapsed() < duration {
            // As the filesystem does: the quick check, else the full (async) admission.
            match engine.try_admit(1) {
                Some(a) => drop(a),
                None => drop(block_on(engine.admit(1)).expect("admit")),
            }
            n += 1;
        }
        with.push(start.elapsed().as_nanos() as f64 / n as f64);
        // The baseline: the same loop with no engine (a clock read and a counter).
        let (mut m, start) = (0u64, Instant::now());
        while start.elapsed() < duration {
            std::hint::black_box(&mut m);
            m += 1;
        }
        without.push(start.elapsed().as_nanos() as f64 / m as f64);
    }
    let t = engine.totals();
    format!(
        "QoS token check (admit 1 token, drop; shm; median of {runs} runs of {duration:?}): \
         {:.0} ns per operation, against {:.0} ns for the bare loop; {} claims of global \
         tokens, {} waits in all.\n",
        median(&with),
        median(&without),
        t.claims,
        t.waits
    )
}
