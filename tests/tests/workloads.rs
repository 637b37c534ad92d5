//! Real tools on real mounts: fio with data verification (installed by scripts/test).

use std::process::Command;

use rackfs_tests::{Mount, TestCluster};

fn fio_verify(m: &Mount, rw: &str) {
    let out = Command::new("fio")
        .args([
            "--name=verify",
            &format!("--directory={}", m.dir.display()),
            &format!("--rw={rw}"),
            "--bs=4k",
            "--size=16M",
            "--numjobs=2",
            "--ioengine=psync",
            "--direct=1",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=json",
        ])
        .output()
        .expect("run fio (scripts/test installs it: apt-get install fio)");
    assert!(
        out.status.success(),
        "fio {rw} with verify failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("fio JSON");
    for job in v["jobs"].as_array().expect("jobs") {
        assert_eq!(job["error"], 0, "fio job error: {job}");
        assert!(
            job["write"]["io_bytes"].as_u64().unwrap_or(0) >= 16 << 20,
            "each job wrote its file"
        );
        assert!(
            job["read"]["io_bytes"].as_u64().unwrap_or(0) >= 16 << 20,
            "and read it back to verify"
        );
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
