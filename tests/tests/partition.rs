//! A memory node on a host of its own (a network namespace joined by a veth pair), partitioned
//! from the primary but not from the mount: no split brain. The node stops serving once its
//! lease lapses, the primary drops it from the replicas, acknowledged writes survive and no read
//! returns the partitioned node's stale copy; when the partition heals the node is taken back.
//! Traffic stays on this machine: loopback and the test's own namespace only.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::{Duration, Instant};

use rackfs_tests::{wait_for, MemNodeProcess, Mount};
use rackfs_verbs::{RemoteAddr, Secret};

/// A network namespace with a veth link to this one; removed (with the link) on drop.
struct Netns {
    name: String,
    /// This side's addresses: the link's and one more (the primary listens there).
    host: String,
    primary: String,
    /// The namespace's address and its end of the link.
    inside: String,
    veth: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    fn new() -> Netns {
        // A subnet and names of this process's own, so parallel runs never meet.
        let k = std::process::id() % 200 + 20;
        let name = format!("rkx{}", std::process::id());
        let (veth_host, veth_ns) = (format!("rkh{k}"), format!("rkn{k}"));
        let net = format!("10.77.{k}");
        let ns = Netns {
            name: name.clone(),
            host: format!("{net}.1"),
            primary: format!("{net}.3"),
            inside: format!("{net}.2"),
            veth: veth_ns.clone(),
        };
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &veth_host])
            .status();
        ip(&["netns", "add", &name]);
        ip(&[
            "link", "add", &veth_host, "type", "veth", "peer", "name", &veth_ns,
        ]);
        ip(&["link", "set", &veth_ns, "netns", &name]);
        ip(&["addr", "add", &format!("{}/24", ns.host), "dev", &veth_host]);
        ip(&[
            "addr",
            "add",
            &format!("{}/32", ns.primary),
            "dev",
            &veth_host,
        ]);
        ip(&["link", "set", &veth_host, "up"]);
        let inside = |args: &[&str]| ip(&[&["netns", "exec", &name, "ip"], args].concat());
        inside(&["addr", "add", &format!("{}/24", ns.inside), "dev", &veth_ns]);
        inside(&["link", "set", &veth_ns, "up"]);
        inside(&["link", "set", "lo", "up"]);
        inside(&[
            "route",
            "add",
            &format!("{}/32", ns.primary),
            "dev",
            &veth_ns,
        ]);
        ns
    }

    /// Cuts (or restores) the namespace's route to the primary's address only.
    fn partition(&self, cut: bool) {
        let to = format!("{}/32", self.primary);
        let route: Vec<&str> = if cut {
            vec!["blackhole", &to]
        } else {
            vec![&to, "dev", &self.veth]
        };
        ip(&[
            &["netns", "exec", &self.name, "ip", "route", "replace"],
            &route[..],
        ]
        .concat());
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

#[test]
fn a_node_partitioned_from_the_primary_but_not_from_the_mount_is_fenced_by_its_lease() {
    let net = Netns::new();
    let secret = Secret::generate();
    let lease = ["--node-lease-ms", "1000", "--quarantine-ms", "200"];
    let primary = MemNodeProcess::start_in(
        &[],
        &format!("{}:0", net.primary),
        "64M",
        secret.clone(),
        &[
            &["--primary", "--node-id", "0", "--name", "mn0"],
            &lease[..],
        ]
        .concat(),
    );
    let join = primary.tcp.clone();
    let peer = MemNodeProcess::start_in(
        &[],
        "127.0.0.1:0",
        "64M",
        secret.clone(),
        &[
            &["--join", &join, "--node-id", "1", "--name", "mn1"],
            &lease[..],
        ]
        .concat(),
    );
    let inside = MemNodeProcess::start_in(
        &["ip", "netns", "exec", &net.name],
        &format!("{}:0", net.inside),
        "64M",
        secret.clone(),
        &[
            &["--join", &join, "--node-id", "2", "--name", "mn2"],
            &lease[..],
        ]
        .concat(),
    );
    let m = Mount::try_new(
        &primary.tcp,
        &primary.secret_file,
        "attr_timeout=0,timeout=1,transport=tcp,stripe_unit=64K",
    )
    .unwrap_or_else(|log| panic!("mount: {log}"));
    const LEN: usize = 12 << 16;
    fs::write(m.path("f"), vec![b'A'; LEN]).unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![b'A'; LEN]);
    let used = |n: &MemNodeProcess| n.control().stats().unwrap().used;
    assert!(used(&inside) >= LEN as u64 / 3, "mn2 holds replicas");
    let _ = peer;

    // A data connection opened while the node holds its lease.
    let early = inside.tcp_qp();
    net.partition(true);
    // mn2 can no longer renew: once its lease lapsed it serves nothing, even to the mount
    // that still reaches it.
    std::thread::sleep(Duration::from_millis(1500));
    // It refuses new data connections, and executes nothing on one opened before.
    match rackfs_verbs::tcp::connect(&inside.tcp, &inside.secret, "probe") {
        Ok(qp) => {
            let rkey = qp.regions()[0].rkey;
            assert!(
                qp.read(RemoteAddr::new(rkey, 0), 8).is_err(),
                "a node whose lease lapsed still serves a read"
            );
        }
        Err(e) => assert!(e.to_string().contains("lease"), "{e}"),
    }
    assert!(
        early
            .read(RemoteAddr::new(early.regions()[0].rkey, 0), 8)
            .is_err(),
        "a node whose lease lapsed still serves a read on a connection opened before"
    );
    let t0 = Instant::now();
    let f = OpenOptions::new().write(true).open(m.path("f")).unwrap();
    f.write_all_at(&vec![b'B'; LEN], 0)
        .unwrap_or_else(|e| panic!("write during the partition: {e}\n{}", m.log_text()));
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![b'B'; LEN]);
    assert!(
        primary.stderr().contains("memory node out of the cluster"),
        "{}",
        primary.stderr()
    );
    // `rackfs status` reaches mn2 (it answers this host) but shows it out of the cluster.
    let status = Command::new(rackfs_tests::bin_path("rackfs"))
        .args(["status", "--cluster", &primary.tcp, "--secret-file"])
        .arg(&primary.secret_file)
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("OUT of the cluster"), "{status}");

    net.partition(false);
    assert!(
        wait_for(Duration::from_secs(10), || primary
            .stderr()
            .contains("memory node back")),
        "mn2 taken back: {}",
        primary.stderr()
    );
    // Its stale copies were freed before it served again: every read is the new data.
    let fresh = Mount::try_new(
        &primary.tcp,
        &primary.secret_file,
        "attr_timeout=0,transport=tcp",
    )
    .unwrap_or_else(|log| panic!("mount: {log}"));
    for mm in [&m, &fresh] {
        assert_eq!(fs::read(mm.path("f")).unwrap(), vec![b'B'; LEN]);
    }
    f.write_all_at(&vec![b'C'; LEN], 0).unwrap();
    assert_eq!(fs::read(fresh.path("f")).unwrap(), vec![b'C'; LEN]);
}
