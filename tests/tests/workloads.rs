//! Real tools on real mounts: fio with data verification (installed by scripts/test).

use rackfs_tests::{Fio, Mount, TestCluster};

fn fio_verify(m: &Mount, rw: &str) {
    let report = Fio::verify("verify", &m.dir, rw, "16M")
        .opt("numjobs", 2)
        .run();
    assert_eq!(report.jobs.len(), 2, "two jobs: {report:?}");
    for job in &report.jobs {
        assert_eq!(job.error, 0, "fio job error: {job:?}");
        assert!(job.write.io_bytes >= 16 << 20, "each job wrote its file");
        assert!(job.read.io_bytes >= 16 << 20, "and read it back to verify");
    }
}

#[test]
fn fio_verify_passes_over_shm_and_tcp() {
    let c = TestCluster::start(2, "128M");
    for opts in ["stripe_unit=256K", "stripe_unit=256K,transport=tcp"] {
        let m = Mount::new(&c, opts);
        fio_verify(&m, "randwrite");
        fio_verify(&m, "write");
    }
}
