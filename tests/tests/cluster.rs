//! Whole-cluster behaviour: several mounts, dying nodes, the CLI's lifecycle and its errors.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::Duration;

use rackfs_fs::mount::is_rackfs_mount;
use rackfs_tests::{bin_path, mapped, wait_for, Mount, TempDir, TestCluster};

/// Two mounts opening the same new names with O_CREAT at once: each open succeeds (one
/// creates, the other opens what was just created), as on a local filesystem; with O_EXCL
/// exactly one wins; with O_TRUNC both succeed.
#[test]
fn concurrent_o_creat_from_two_mounts_never_fails() {
    let c = TestCluster::start(1, "64M");
    let (a, b) = (Mount::new(&c, ""), Mount::new(&c, "transport=tcp"));
    // Both mounts open the same 300 names at once; the pairs of outcomes, by name.
    let race = |excl: bool, trunc: bool| {
        let run = |m: &Mount| {
            let dir = m.dir.clone();
            std::thread::spawn(move || {
                (0..300)
                    .map(|i| {
                        OpenOptions::new()
                            .write(true)
                            .create(!excl)
                            .create_new(excl)
                            .truncate(trunc)
                            .open(dir.join(format!("{}{i}", if excl { "x" } else { "c" })))
                            .map(|_| ())
                            .map_err(|e| e.raw_os_error())
                    })
                    .collect::<Vec<_>>()
            })
        };
        let (ra, rb) = (run(&a), run(&b));
        ra.join()
            .unwrap()
            .into_iter()
            .zip(rb.join().unwrap())
            .enumerate()
            .collect::<Vec<_>>()
    };
    for trunc in [false, true] {
        for (i, (x, y)) in race(false, trunc) {
            assert_eq!((x, y), (Ok(()), Ok(())), "O_CREAT (trunc {trunc}) of c{i}");
        }
        for i in 0..300 {
            fs::remove_file(a.path(&format!("c{i}"))).unwrap();
        }
    }
    for (i, (x, y)) in race(true, false) {
        let won = [x, y].iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1, "O_EXCL of x{i}: {x:?} {y:?}");
        assert!(
            [x, y].contains(&Err(Some(libc::EEXIST))),
            "x{i}: {x:?} {y:?}"
        );
    }
}

#[test]
fn writes_are_visible_on_another_mount_when_write_returns() {
    let c = TestCluster::start(2, "32M");
    let a = Mount::new(&c, "");
    let b = Mount::new(&c, "transport=tcp");
    let fa = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(a.path("shared"))
        .unwrap();
    let fb = OpenOptions::new()
        .read(true)
        .write(true)
        .open(b.path("shared"))
        .unwrap();
    for i in 0..200u64 {
        let data = format!("round {i:05}");
        let (w, r) = if i % 2 == 0 { (&fa, &fb) } else { (&fb, &fa) };
        w.write_all_at(data.as_bytes(), i * 4096 + 17).unwrap();
        let mut back = vec![0u8; data.len()];
        r.read_exact_at(&mut back, i * 4096 + 17).unwrap();
        assert_eq!(back, data.as_bytes(), "round {i}");
    }
    // Namespace changes too.
    fs::create_dir(a.path("dir")).unwrap();
    fs::write(a.path("dir/x"), b"x").unwrap();
    assert_eq!(fs::read(b.path("dir/x")).unwrap(), b"x");
}

/// Two mounts write interleaved 4 KiB blocks of the same small files at once, so each file's
/// extent is moved to larger ones while the other mount writes to it: no write is lost.
#[test]
fn two_mounts_growing_the_same_small_files_lose_no_write() {
    let c = TestCluster::start(2, "32M");
    let (a, b) = (
        Mount::new(&c, "attr_timeout=0"),
        Mount::new(&c, "attr_timeout=0,transport=tcp"),
    );
    const FILES: usize = 6;
    const BLOCKS: u64 = 48; // 192 KiB per file: five moves of the first stripe
    for f in 0..FILES {
        fs::write(a.path(&format!("g{f}")), b"").unwrap();
    }
    let block = |f: usize, k: u64| vec![(f as u8) << 4 | (k % 16) as u8 | 1; 4096];
    let writer = |m: &Mount, parity: u64| {
        let dir = m.dir.clone();
        std::thread::spawn(move || {
            let files: Vec<fs::File> = (0..FILES)
                .map(|f| {
                    OpenOptions::new()
                        .write(true)
                        .open(dir.join(format!("g{f}")))
                        .unwrap()
                })
                .collect();
            for k in (parity..BLOCKS).step_by(2) {
                for (f, h) in files.iter().enumerate() {
                    h.write_all_at(&block(f, k), k * 4096).unwrap();
                }
            }
        })
    };
    let (wa, wb) = (writer(&a, 0), writer(&b, 1));
    wa.join().unwrap();
    wb.join().unwrap();
    for m in [&a, &b] {
        for f in 0..FILES {
            let data = fs::read(m.path(&format!("g{f}"))).unwrap();
            assert_eq!(data.len() as u64, BLOCKS * 4096);
            for k in 0..BLOCKS {
                let at = (k * 4096) as usize;
                assert!(
                    data[at..at + 4096] == block(f, k)[..],
                    "file g{f} block {k} read through {}: lost",
                    m.dir.display()
                );
            }
        }
    }
}

/// With long kernel caches (attr_timeout=30) on both mounts, every namespace or attribute
/// change made on one mount is seen by the other as soon as it returns.
#[test]
fn changes_on_one_mount_are_seen_at_once_by_another() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let c = TestCluster::start(1, "64M");
    let (a, b) = (
        Mount::new(&c, "attr_timeout=30"),
        Mount::new(&c, "attr_timeout=30,transport=tcp"),
    );
    for (this, other) in [(&a, &b), (&b, &a)] {
        let (p, q) = (|n: &str| this.path(n), |n: &str| other.path(n));
        for n in ["x", "y", "f", "g"] {
            fs::write(p(n), b"12345").unwrap();
        }
        fs::create_dir(p("d")).unwrap();
        // The other mount's kernel caches every entry and attribute.
        for n in ["x", "y", "f", "g", "d"] {
            fs::metadata(q(n)).unwrap();
        }
        let gone = |n: &str| {
            fs::metadata(q(n)).map_err(|e| e.raw_os_error()).err() == Some(Some(libc::ENOENT))
        };
        fs::remove_file(p("x")).unwrap();
        assert!(gone("x"), "unlink seen");
        fs::rename(p("y"), p("y2")).unwrap();
        assert!(gone("y"), "rename: old name gone");
        assert_eq!(fs::read(q("y2")).unwrap(), b"12345");
        fs::remove_dir(p("d")).unwrap();
        assert!(gone("d"), "rmdir seen");
        fs::set_permissions(p("f"), fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            fs::metadata(q("f")).unwrap().mode() & 0o777,
            0o600,
            "chmod seen"
        );
        OpenOptions::new()
            .write(true)
            .open(p("f"))
            .unwrap()
            .set_len(3)
            .unwrap();
        assert_eq!(fs::metadata(q("f")).unwrap().len(), 3, "truncate seen");
        fs::hard_link(p("f"), p("f2")).unwrap();
        assert_eq!(fs::metadata(q("f")).unwrap().nlink(), 2, "link count seen");
        std::os::unix::fs::chown(p("g"), Some(1000), None).unwrap();
        assert_eq!(fs::metadata(q("g")).unwrap().uid(), 1000, "chown seen");
        // A name renamed over another: the other mount sees the new file under it.
        fs::write(p("g2"), b"new").unwrap();
        fs::rename(p("g2"), p("g")).unwrap();
        assert_eq!(
            fs::metadata(q("g")).unwrap().len(),
            3,
            "rename over a name seen"
        );
        for n in ["y2", "f", "f2", "g"] {
            fs::remove_file(p(n)).unwrap();
        }
    }
}

/// Two mounts removing and renaming names in one directory at once: each one's kernel holds
/// the directory's lock while its operation waits for the other's watcher, which needs that
/// lock; the primary does not wait for a mount that is itself waiting, so nothing stalls for
/// the (30 s) attr_timeout.
#[test]
fn concurrent_changes_in_one_directory_from_two_mounts_do_not_stall() {
    let c = TestCluster::start(1, "64M");
    let (a, b) = (
        Mount::new(&c, "attr_timeout=30"),
        Mount::new(&c, "attr_timeout=30,transport=tcp"),
    );
    fs::create_dir(a.path("d")).unwrap();
    for i in 0..400 {
        fs::write(a.path(&format!("d/n{i}")), b"x").unwrap();
    }
    let t0 = std::time::Instant::now();
    let run = |m: &Mount, parity: usize| {
        let dir = m.path("d");
        std::thread::spawn(move || {
            for i in (parity..400).step_by(2) {
                if i % 4 < 2 {
                    fs::remove_file(dir.join(format!("n{i}"))).unwrap();
                } else {
                    fs::rename(dir.join(format!("n{i}")), dir.join(format!("r{i}"))).unwrap();
                }
            }
        })
    };
    let (ta, tb) = (run(&a, 0), run(&b, 1));
    ta.join().unwrap();
    tb.join().unwrap();
    let took = t0.elapsed();
    eprintln!("400 removals and renames from two mounts in one directory: {took:?}");
    assert!(took < Duration::from_secs(30), "stalled: {took:?}");
    for m in [&a, &b] {
        assert_eq!(fs::read_dir(m.path("d")).unwrap().count(), 200);
        assert!(fs::metadata(m.path("d/n0")).is_err() && fs::metadata(m.path("d/r2")).is_ok());
    }
}

/// A mount that stops answering (SIGSTOP) delays another mount's change by at most its own
/// attr_timeout, once; later changes do not wait for it; it catches up after SIGCONT.
#[test]
fn a_stopped_mount_delays_changes_elsewhere_once_by_its_attr_timeout() {
    let c = TestCluster::start(1, "64M");
    let a = Mount::new(&c, "attr_timeout=30");
    let stopped = Mount::new(&c, "attr_timeout=2,transport=tcp");
    for i in 0..3 {
        fs::write(a.path(&format!("s{i}")), b"x").unwrap();
        fs::metadata(stopped.path(&format!("s{i}"))).unwrap();
    }
    let pid = stopped.child.id() as i32;
    // SAFETY: signalling a child process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let t0 = std::time::Instant::now();
    fs::remove_file(a.path("s0")).unwrap();
    let first = t0.elapsed();
    let t0 = std::time::Instant::now();
    fs::remove_file(a.path("s1")).unwrap();
    let second = t0.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    eprintln!("unlink with a stopped mount: first {first:?}, then {second:?}");
    assert!(
        first < Duration::from_secs(10),
        "waited {first:?} for a stopped mount"
    );
    assert!(
        second < first,
        "the stopped mount was waited for twice: {second:?}"
    );
    // After SIGCONT it catches up and is waited for again: its kernel forgets at once.
    assert!(wait_for(Duration::from_secs(10), || fs::metadata(
        stopped.path("s1")
    )
    .is_err()));
    fs::remove_file(a.path("s2")).unwrap();
    assert!(
        fs::metadata(stopped.path("s2")).is_err(),
        "caught-up mount sees the change at once"
    );
}

#[test]
fn steady_state_io_makes_no_control_rpc() {
    let c = TestCluster::start(2, "32M");
    let m = Mount::new(&c, "stripe_unit=64K");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("hot"))
        .unwrap();
    f.write_all_at(&vec![1u8; 256 << 10], 0).unwrap(); // allocates the stripes
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 0).unwrap();
    // Lease renewals (mounts' and data nodes' with the embedded coordinator, each on a
    // connection of its own), the watcher's polls (three a second, on its own connection)
    // and the mount's look at the cluster's nodes (once a second) are not on the I/O path.
    let kind = |name: &str| {
        rackfs_proto::control::RPC_KINDS
            .iter()
            .position(|k| *k == name)
            .unwrap()
    };
    let periodic = [kind("renew"), kind("coord"), kind("watch"), kind("cluster")];
    let rpcs = |c: &TestCluster| -> u64 {
        (0..2)
            .map(|i| {
                let s = c.control(i).stats().unwrap();
                s.rpcs.iter().sum::<u64>() - periodic.iter().map(|&k| s.rpcs[k]).sum::<u64>()
            })
            .sum()
    };
    let verbs = |c: &TestCluster| -> u64 {
        (0..2)
            .map(|i| c.control(i).stats().unwrap().verbs.total_ops())
            .sum()
    };
    let (r0, v0) = (rpcs(&c), verbs(&c));
    for i in 0..500u64 {
        f.write_all_at(&[i as u8; 4096], (i % 64) * 4096).unwrap();
        f.read_exact_at(&mut buf, ((i * 7) % 64) * 4096).unwrap();
    }
    let (r1, v1) = (rpcs(&c), verbs(&c));
    // The only RPCs in between are this measurement's own: 4 connections, each a hello (the
    // protocol version check) and a stats call.
    assert_eq!(r1 - r0, 8, "control RPCs during 1000 reads and writes");
    assert!(v1 - v0 >= 2000, "every I/O was verbs: {} verbs", v1 - v0);
}

/// With one replica (`replicas=1`), a dead node fails the files whose data it held, and only
/// those.
#[test]
fn a_dead_memory_node_fails_its_unreplicated_files_only_over_shm() {
    dead_node_case("");
}

#[test]
fn a_dead_memory_node_fails_its_unreplicated_files_only_over_tcp() {
    dead_node_case("transport=tcp");
}

fn dead_node_case(transport: &str) {
    let mut c = TestCluster::start(2, "32M");
    let m = Mount::new(
        &c,
        &format!("attr_timeout=0,stripe_unit=64K,replicas=1,{transport}"),
    );
    // Small files: stripe 0 of inode i lands on node (i % 2), so some live on each node.
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), format!("file {i}")).unwrap();
    }
    c.kill(1);
    let mut ok = 0;
    let mut eio = 0;
    for i in 0..6 {
        match fs::read(m.path(&format!("f{i}"))) {
            Ok(d) => {
                assert_eq!(d, format!("file {i}").as_bytes());
                ok += 1;
            }
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "f{i}: {e}");
                eio += 1;
            }
        }
    }
    assert!(
        ok > 0 && eio > 0,
        "some files on each node: {ok} ok, {eio} EIO"
    );
    // The mount stays up: the namespace and the surviving node keep working.
    assert!(is_rackfs_mount(&m.dir));
    assert_eq!(fs::read_dir(&m.dir).unwrap().count(), 6);
    fs::create_dir(m.path("still-works")).unwrap();
    // New files all land on the surviving node, however many and however large.
    for i in 0..6 {
        fs::write(m.path(&format!("new{i}")), vec![i as u8; 100 << 10]).unwrap();
    }
    fs::write(m.path("new-big"), vec![7u8; 3 << 20]).unwrap();
    assert_eq!(fs::read(m.path("new-big")).unwrap(), vec![7u8; 3 << 20]);
    // A new mount of the degraded cluster says so.
    let again = Mount::new(&c, transport);
    let log = fs::read_to_string(&again.log).unwrap_or_default();
    assert!(log.contains("degraded"), "the new mount warns: {log}");
}

fn run_rackfs(args: &[&str]) -> std::process::Output {
    Command::new(bin_path("rackfs"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn mount_rejects_bad_input_clearly() {
    let c = TestCluster::start(1, "16M");
    let dir = TempDir::new("badmnt");
    let d = dir.path().to_str().unwrap();
    let sf = format!("secret_file={}", c.secret_file.display());
    let addr = c.addr();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                addr.clone(),
                d.into(),
                "-o".into(),
                format!("{sf},frobnicate"),
            ],
            "unknown mount option",
        ),
        (
            vec![
                addr.clone(),
                d.into(),
                "-o".into(),
                format!("{sf},stripe_unit=12Q"),
            ],
            "unknown unit",
        ),
        (
            vec!["127.0.0.1:1".into(), d.into(), "-o".into(), sf.clone()],
            "cannot reach",
        ),
        (
            vec!["nonsense".into(), d.into(), "-o".into(), sf.clone()],
            "invalid cluster address",
        ),
        (
            vec![
                addr.clone(),
                "/nonexistent/dir".into(),
                "-o".into(),
                sf.clone(),
            ],
            "No such file",
        ),
        (
            vec![
                addr.clone(),
                d.into(),
                "-o".into(),
                "secret_file=/nonexistent".into(),
            ],
            "cannot read secret file",
        ),
    ];
    for (args, says) in cases {
        let mut all = vec!["mount"];
        all.extend(args.iter().map(String::as_str));
        let out = run_rackfs(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(says), "{args:?}: expected {says:?} in {err:?}");
    }
    // Wrong secret.
    let wrong = dir.path().join("wrong");
    fs::write(&wrong, rackfs_verbs::Secret::generate().expose()).unwrap();
    let mnt = TempDir::new("m2");
    let out = run_rackfs(&[
        "mount",
        &addr,
        mnt.path().to_str().unwrap(),
        "-o",
        &format!("secret_file={}", wrong.display()),
    ]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("wrong cluster secret"),
        "{out:?}"
    );
    // Busy mount point.
    let m = Mount::new(&c, "");
    let out = run_rackfs(&["mount", &addr, m.dir.to_str().unwrap(), "-o", &sf]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("busy"),
        "{out:?}"
    );
    // Daemonized mount, then umount(8).
    let out = run_rackfs(&["mount", &addr, d, "-o", &sf]);
    assert!(out.status.success(), "{out:?}");
    assert!(is_rackfs_mount(dir.path()));
    fs::write(dir.path().join("x"), b"1").unwrap();
    assert!(Command::new("umount").arg(d).status().unwrap().success());
    assert!(wait_for(Duration::from_secs(5), || !is_rackfs_mount(
        dir.path()
    )));
}

/// `mount -t rackfs` and an fstab line, through the installed helper.
#[test]
fn mount_helper_and_fstab() {
    let helper = std::path::Path::new("/sbin/mount.rackfs");
    let installed_here = !helper.exists();
    if installed_here {
        std::os::unix::fs::symlink(bin_path("mount-rackfs"), helper)
            .expect("install /sbin/mount.rackfs (tests run as root)");
    }
    let c = TestCluster::start(1, "16M");
    let dir = TempDir::new("helper");
    let d = dir.path().to_str().unwrap();
    let opts = format!(
        "_netdev,secret_file={},transport=tcp",
        c.secret_file.display()
    );
    let out = Command::new("mount")
        .args(["-t", "rackfs", &c.addr(), d, "-o", &opts])
        .output()
        .unwrap();
    assert!(out.status.success(), "mount -t rackfs: {out:?}");
    fs::write(dir.path().join("via-mount"), b"ok").unwrap();
    assert!(Command::new("umount").arg(d).status().unwrap().success());
    assert!(wait_for(Duration::from_secs(5), || !is_rackfs_mount(
        dir.path()
    )));

    let fstab = dir.path().with_extension("fstab");
    fs::write(
        &fstab,
        format!("# test fstab\n{} {d} rackfs {opts} 0 0\n", c.addr()),
    )
    .unwrap();
    let out = Command::new("mount")
        .args(["-T", fstab.to_str().unwrap(), d])
        .output()
        .unwrap();
    assert!(out.status.success(), "mount from fstab: {out:?}");
    assert_eq!(
        fs::read(dir.path().join("via-mount")).unwrap(),
        b"ok",
        "same cluster, same data"
    );
    assert!(Command::new("umount").arg(d).status().unwrap().success());
    let _ = fs::remove_file(&fstab);
    // A bad option through the helper fails with mount's failure code and a message.
    let out = Command::new("mount")
        .args(["-t", "rackfs", &c.addr(), d, "-o", "bogus=1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(32));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown mount option"),
        "{out:?}"
    );
    if installed_here {
        let _ = fs::remove_file(helper);
    }
}

#[test]
fn rackfs_up_and_down_leave_nothing_behind() {
    let dir = TempDir::new("up");
    let d = dir.path().join("m");
    let ds = d.to_str().unwrap();
    // Bad mount options fail before anything starts.
    let out = run_rackfs(&["up", ds, "--detach", "-o", "bogus=1"]);
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("unknown mount option"),
        "{out:?}"
    );
    assert!(!is_rackfs_mount(&d));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = run_rackfs(&[
        "up",
        ds,
        "--detach",
        "--region",
        "64M",
        "-o",
        &format!("limit=50000,stripe_unit=64K,metrics=127.0.0.1:{port}"),
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("RackFS is up") && text.contains("rackfs down"),
        "{text}"
    );
    assert!(is_rackfs_mount(&d));
    // It is a fuse.rackfs mount, as df -t and findmnt -t see it.
    let canon = fs::canonicalize(&d).unwrap();
    assert_eq!(
        rackfs_fs::mount::mount_type(&canon).unwrap().0,
        "fuse.rackfs"
    );
    let found = Command::new("findmnt")
        .args(["-n", "-t", "fuse.rackfs"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&found.stdout).contains(canon.to_str().unwrap()),
        "{found:?}"
    );
    // `rackfs status DIR`: this mount's cluster and its own QoS, with the -o limit.
    let st = run_rackfs(&["status", ds]);
    let st = String::from_utf8_lossy(&st.stdout);
    assert!(st.contains("QoS slot") && st.contains("this mount"), "{st}");
    let own = st
        .lines()
        .find(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()) && l.contains('*'));
    assert!(own.is_some_and(|l| l.contains("50000")), "{st}");
    // The nodes' QoS capacity was measured on this machine, not assumed.
    assert!(st.contains("(profiled)") && !st.contains("assumed"), "{st}");
    let record = rackfs_fs::mount::MountRecord::read(&canon).expect("a record while mounted");
    assert!(record.qos_slot.is_some());
    fs::write(d.join("hello"), b"hello").unwrap();
    assert_eq!(fs::read(d.join("hello")).unwrap(), b"hello");
    // `-o metrics=` serves the mount's metrics under `rackfs up` too.
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Write::write_all(&mut c, b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    std::io::Read::read_to_string(&mut c, &mut page).expect("the metrics page within 10 s");
    assert!(
        page.starts_with("HTTP/1.0 200 OK") && page.contains("rackfs_mount_op_seconds_count"),
        "{page}"
    );
    let status = run_rackfs(&["status"]);
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("mn1"),
        "{status:?}"
    );
    let inst = rackfs_cli::up::instance_dir(&fs::canonicalize(&d).unwrap());
    let up_pid: i32 =
        rackfs_cli::up::state_value(&rackfs_cli::up::read_state(&inst).unwrap(), "pid")
            .unwrap()
            .parse()
            .unwrap();
    let node_pids = child_pids(up_pid);
    assert_eq!(node_pids.len(), 2, "two memory nodes");

    let log = rackfs_fs::mount::state_dir().join(format!(
        "up-{}.log",
        rackfs_fs::mount::path_tag(&fs::canonicalize(&d).unwrap())
    ));
    assert!(log.exists(), "a detached run logs to {}", log.display());
    let out = run_rackfs(&["down", ds]);
    assert!(out.status.success(), "{out:?}");
    assert!(!is_rackfs_mount(&d), "unmounted");
    assert!(!inst.exists(), "state removed");
    assert!(!log.exists(), "log of a cleanly stopped instance removed");
    assert!(
        rackfs_fs::mount::MountRecord::read(&canon).is_none(),
        "the mount's record goes with it"
    );
    for p in node_pids.iter().chain([&up_pid]) {
        assert!(
            wait_for(Duration::from_secs(5), || !rackfs_cli::up::pid_alive(*p)),
            "pid {p} stopped"
        );
    }
    let out = run_rackfs(&["down", ds]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no RackFS"));

    // kill -9 of `rackfs up`: its memory nodes die with it.
    let out = run_rackfs(&["up", ds, "--detach", "--region", "64M"]);
    assert!(out.status.success(), "{out:?}");
    let up_pid: i32 =
        rackfs_cli::up::state_value(&rackfs_cli::up::read_state(&inst).unwrap(), "pid")
            .unwrap()
            .parse()
            .unwrap();
    let node_pids = child_pids(up_pid);
    // SAFETY: SIGKILL to the `rackfs up` process this test started.
    unsafe { libc::kill(up_pid, libc::SIGKILL) };
    for p in &node_pids {
        assert!(
            wait_for(Duration::from_secs(5), || !rackfs_cli::up::pid_alive(*p)),
            "node {p} died with its parent"
        );
    }
    let out = run_rackfs(&["down", ds]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is gone"),
        "{out:?}"
    );
    assert!(!is_rackfs_mount(&d), "stale mount cleaned up");
}

fn child_pids(parent: i32) -> Vec<i32> {
    let mut v = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let ppid: i32 = rest
            .split(' ')
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        if ppid == parent {
            v.push(pid);
        }
    }
    v
}

#[test]
fn writeback_cache_mode_round_trips_data() {
    let c = TestCluster::start(1, "32M");
    let m = Mount::new(&c, "cache=writeback");
    let data: Vec<u8> = (0..(3 << 20)).map(|i| (i % 251) as u8).collect();
    fs::write(m.path("wb"), &data).unwrap();
    assert_eq!(fs::read(m.path("wb")).unwrap(), data);
    // After close the data is on the memory nodes: another (direct I/O) mount reads it.
    let other = Mount::new(&c, "");
    assert_eq!(fs::read(other.path("wb")).unwrap(), data);
}

#[test]
fn a_killed_mount_releases_its_open_files() {
    let c = TestCluster::start(1, "32M");
    let used = |c: &TestCluster| c.control(0).stats().unwrap().used;
    let base = used(&c);
    let survivor = Mount::new(&c, "");
    let mut victim = Mount::new(&c, "");
    fs::write(victim.path("orphan"), vec![5u8; 2 << 20]).unwrap();
    let held = std::fs::File::open(victim.path("orphan")).unwrap();
    fs::remove_file(survivor.path("orphan")).unwrap(); // unlinked while the victim holds it open
    assert!(used(&c) >= base + (2 << 20), "still allocated while open");
    // SIGKILL the mount process holding the file open.
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    drop(held);
    // Its record outlives it until the next mount writes its own.
    let record = rackfs_fs::mount::state_dir().join(format!(
        "mount-{}.state",
        rackfs_fs::mount::path_tag(&victim.dir.canonicalize().unwrap_or(victim.dir.clone()))
    ));
    assert!(
        record.exists(),
        "{} (the killed mount's record)",
        record.display()
    );
    let _next = Mount::new(&c, "");
    assert!(!record.exists(), "a killed mount's record stays behind");
    assert!(
        wait_for(Duration::from_secs(5), || used(&c) < base + (1 << 20)),
        "the dead mount's open file is released and its memory returned"
    );
    assert!(fs::read_dir(&survivor.dir).unwrap().next().is_none());
}

/// Files in the filesystem, as `statvfs(3)` counts them through mount `m` (inodes the primary
/// holds, unlinked ones still open included); it sends none of the other mount's closes.
fn files_counted(m: &Mount) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(m.dir.as_os_str().as_bytes()).unwrap();
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `st` is writable memory of a `statvfs`'s size.
    let r = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    assert_eq!(r, 0, "statvfs {}", m.dir.display());
    // SAFETY: statvfs succeeded, so it filled `st`.
    unsafe { st.assume_init() }.f_files
}

/// A mount keeps its open of a file past the last close and reopens it without asking the
/// primary (`rackfs_fs::kept`): another mount's writes still show at that reopen, its unlink
/// still makes the name go at once and the file within about 50 ms (the mount gives the
/// open back when its watcher hears of it), and the mount's own unlink frees the file before
/// it returns.
#[test]
fn an_open_a_mount_keeps_past_its_close_holds_nothing_up() {
    let c = TestCluster::start(1, "64M");
    let (a, b) = (Mount::new(&c, ""), Mount::new(&c, "transport=tcp"));
    let base = files_counted(&b);
    fs::write(a.path("f"), vec![1u8; 64 << 10]).unwrap();
    assert_eq!(fs::read(a.path("f")).unwrap(), vec![1u8; 64 << 10]);
    // Another mount's write shows at the reopen.
    let h = OpenOptions::new().write(true).open(b.path("f")).unwrap();
    h.write_all_at(&[2u8; 4096], 8192).unwrap();
    drop(h);
    let got = fs::read(a.path("f")).unwrap();
    assert!(got[8192..12288].iter().all(|&x| x == 2), "b's write seen");
    assert!(got[..8192].iter().all(|&x| x == 1));
    // Another mount's unlink: the name goes at once, the file once `a` gives its open back.
    assert_eq!(files_counted(&b), base + 1);
    fs::remove_file(b.path("f")).unwrap();
    let e = fs::File::open(a.path("f")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    assert!(
        wait_for(Duration::from_secs(5), || files_counted(&b) == base),
        "the file another mount kept open went: {} files, {base} before",
        files_counted(&b)
    );
    // The mount's own unlink of a file it kept: gone when the unlink returns.
    for n in 0..20 {
        let name = format!("g{n}");
        fs::write(a.path(&name), b"small").unwrap();
        assert_eq!(fs::read(a.path(&name)).unwrap(), b"small");
    }
    assert_eq!(files_counted(&b), base + 20);
    for n in 0..20 {
        fs::remove_file(a.path(&format!("g{n}"))).unwrap();
        assert_eq!(
            files_counted(&b),
            base + 19 - n,
            "g{n} went with its unlink"
        );
    }
}

#[test]
fn shared_mappings_read_and_write_through_two_mounts() {
    const LEN: usize = 64 << 10;
    let c = TestCluster::start(2, "64M");
    let (a, b) = (Mount::new(&c, ""), Mount::new(&c, "transport=tcp"));
    let pattern: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    fs::write(a.path("mapped"), &pattern).unwrap();
    let open_rw = |m: &Mount| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path("mapped"))
            .unwrap()
    };
    mapped(&open_rw(&a), LEN, |map| {
        assert_eq!(&map[..], &pattern[..], "a mapped read sees the file");
        map[4096..8192].fill(0xaa);
        map[LEN - 1] = 0xbb;
    });
    // Once msync returns, the other mount reads the mapped writes.
    let got = fs::read(b.path("mapped")).unwrap();
    assert!(got[4096..8192].iter().all(|&x| x == 0xaa));
    assert_eq!(got[LEN - 1], 0xbb);
    assert_eq!(&got[..4096], &pattern[..4096]);
    // A write on the other mount is seen by a mapping opened after it.
    open_rw(&b).write_all_at(&[0xcc; 4096], 0).unwrap();
    mapped(&open_rw(&a), LEN, |map| {
        assert!(
            map[..4096].iter().all(|&x| x == 0xcc),
            "a new mapping sees the other mount's write"
        );
        map[8192] = 0xdd;
    });
    assert_eq!(fs::read(b.path("mapped")).unwrap()[8192], 0xdd);
}

#[test]
fn a_write_through_a_layout_older_than_the_quarantine_never_lands_in_reused_memory() {
    // One node, so freed stripes come back to the next allocations; 200 ms quarantine.
    let c = TestCluster::start(1, "64M");
    let a = Mount::new(&c, "stripe_unit=64K,attr_timeout=0");
    let b = Mount::new(&c, "stripe_unit=64K,attr_timeout=0,transport=tcp");
    let unit = 64 << 10;
    // B writes four stripes of f and keeps f open: its layout stays cached.
    let fb = OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(true)
        .open(b.path("f"))
        .unwrap();
    fb.write_all_at(&vec![1u8; 4 * unit], 0).unwrap();
    // A empties f; its stripes are quarantined, then reused by g.
    OpenOptions::new()
        .write(true)
        .open(a.path("f"))
        .unwrap()
        .set_len(0)
        .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    fs::write(a.path("g"), vec![0x11u8; 4 * unit]).unwrap();
    // B writes through its old layout: the write must go to f, never to g's memory.
    fb.write_all_at(&vec![0x22u8; unit], 0).unwrap();
    let g = fs::read(a.path("g")).unwrap();
    assert!(
        g.iter().all(|&x| x == 0x11),
        "another file's data landed in g: {} bytes changed",
        g.iter().filter(|&&x| x != 0x11).count()
    );
    let f = fs::read(a.path("f")).unwrap();
    assert_eq!(f.len(), unit);
    assert!(f.iter().all(|&x| x == 0x22));
}

/// The pid among `pids` whose command line has `--node-id ID`.
fn node_pid(pids: &[i32], id: &str) -> i32 {
    *pids
        .iter()
        .find(|p| {
            let cmd = fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"--node-id" && w[1] == id.as_bytes())
        })
        .expect("a memory node with that id")
}

#[test]
fn rackfs_up_keeps_serving_when_a_data_node_dies() {
    up_survives_a_dead_data_node(&[], "embedded, served at unix:");
}

/// The same on a local etcd (`rackfs up --etcd`), which `rackfs down` stops too.
#[test]
fn rackfs_up_on_etcd_keeps_serving_when_a_data_node_dies() {
    up_survives_a_dead_data_node(&["--etcd"], "etcd 127.0.0.1:");
}

fn up_survives_a_dead_data_node(flags: &[&str], coordinator: &str) {
    let dir = TempDir::new("up-dead");
    let d = dir.path().join("m");
    let ds = d.to_str().unwrap();
    let out = run_rackfs(&[&["up", ds, "--detach", "--region", "64M"], flags].concat());
    assert!(out.status.success(), "{out:?}");
    let inst = rackfs_cli::up::instance_dir(&fs::canonicalize(&d).unwrap());
    let up_pid: i32 =
        rackfs_cli::up::state_value(&rackfs_cli::up::read_state(&inst).unwrap(), "pid")
            .unwrap()
            .parse()
            .unwrap();
    // Written before the death: `rackfs up` keeps two copies of everything, so these survive.
    let before: Vec<Vec<u8>> = (0..4).map(|i| vec![0x40 + i as u8; 300 << 10]).collect();
    for (i, data) in before.iter().enumerate() {
        fs::write(d.join(format!("before{i}")), data).unwrap();
    }
    let children = child_pids(up_pid);
    let mn1 = node_pid(&children, "1");
    // SAFETY: SIGKILL to a memory node process this test's `rackfs up` started.
    unsafe { libc::kill(mn1, libc::SIGKILL) };
    assert!(wait_for(Duration::from_secs(5), || {
        !rackfs_cli::up::pid_alive(mn1)
    }));
    std::thread::sleep(Duration::from_millis(500));
    assert!(is_rackfs_mount(&d), "the mount survives a data node");
    assert!(rackfs_cli::up::pid_alive(up_pid), "rackfs up keeps running");
    for (i, data) in before.iter().enumerate() {
        assert_eq!(
            &fs::read(d.join(format!("before{i}"))).unwrap(),
            data,
            "before{i}"
        );
    }
    // New files go to the surviving node: all of them work, small and over a stripe.
    for i in 0..6 {
        let data = vec![i as u8 + 1; 100 << 10];
        fs::write(d.join(format!("small{i}")), &data).unwrap();
        assert_eq!(fs::read(d.join(format!("small{i}"))).unwrap(), data);
    }
    let big = vec![9u8; 3 << 20];
    fs::write(d.join("big"), &big).unwrap();
    assert_eq!(fs::read(d.join("big")).unwrap(), big);
    // The primary knows and says so (unless `rackfs up`, which starts the dead node again,
    // already brought it back and refilled it: then it says that).
    assert!(
        wait_for(Duration::from_secs(5), || {
            let s = run_rackfs(&["status"]);
            let s = String::from_utf8_lossy(&s.stdout).to_string();
            (s.contains("DEGRADED") && s.contains("data: degraded"))
                || (s.contains("mn1 exited") && s.contains("mn1 is back"))
        }),
        "rackfs status reports the cluster and its files degraded: {}",
        String::from_utf8_lossy(&run_rackfs(&["status"]).stdout)
    );
    let status = String::from_utf8_lossy(&run_rackfs(&["status"]).stdout).to_string();
    assert!(
        status.contains(&format!("coordinator: {coordinator}")),
        "{status}"
    );
    let out = run_rackfs(&["down", ds]);
    assert!(out.status.success(), "{out:?}");
    assert!(!is_rackfs_mount(&d));
    for pid in children {
        assert!(
            wait_for(Duration::from_secs(5), || !rackfs_cli::up::pid_alive(pid)),
            "process {pid} that rackfs up started outlives rackfs down"
        );
    }
}

/// `program path`, blocked on a stopped node, dies at once when killed.
fn killable_while_blocked(program: &str, path: &std::path::Path) {
    let mut child = Command::new(program).arg(path).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    child.kill().unwrap();
    let t0 = std::time::Instant::now();
    child.wait().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "kill -9 of {program} took {:?}",
        t0.elapsed()
    );
}

/// The mount's log says `what` about node `node`.
/// `program path` fails with "Input/output error" within `bound`.
fn fails_with_eio_within(program: &str, path: &std::path::Path, bound: Duration) {
    let t0 = std::time::Instant::now();
    let out = Command::new(program).arg(path).output().unwrap();
    let took = t0.elapsed();
    assert!(!out.status.success(), "{program} succeeded: {out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Input/output error"),
        "{out:?}"
    );
    assert!(took < bound, "{program} took {took:?}");
}

fn log_names(m: &Mount, what: &str, node: &str) {
    let log = fs::read_to_string(&m.log).unwrap_or_default();
    assert!(log.contains(what) && log.contains(node), "{log}");
}

/// Over tcp, a data node that stops answering (SIGSTOP) fails reads and writes of stripes it
/// alone holds (`replicas=1`) with EIO after the mount's `timeout=`; a write that failed so never lands when the node
/// resumes; then the mount serves again.
#[test]
fn a_stopped_data_node_fails_io_over_tcp_within_the_deadline_and_recovers() {
    let c = TestCluster::start(2, "64M");
    let m = Mount::new(
        &c,
        "attr_timeout=0,timeout=1,transport=tcp,stripe_unit=64K,qos=off,replicas=1",
    );
    const STRIPES: usize = 8; // spread over both nodes
    fs::write(m.path("f"), vec![b'A'; STRIPES << 16]).unwrap();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    // Read it all just before the stop, so the write below finds its stripes seen live
    // recently and sends its data at once (no tag check of its own first).
    let mut back = vec![0u8; STRIPES << 16];
    f.read_exact_at(&mut back, 0).unwrap();
    let pid = c.nodes[1].as_ref().unwrap().child.id() as i32;
    // SAFETY: SIGSTOP to the memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let t0 = std::time::Instant::now();
    let err = f.write_all_at(&vec![b'B'; STRIPES << 16], 0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "write took {:?}",
        t0.elapsed()
    );
    fails_with_eio_within("cat", &m.path("f"), Duration::from_secs(5));
    killable_while_blocked("cat", &m.path("f"));
    log_names(&m, "no answer within", "mn1");
    // SAFETY: SIGCONT to the same process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    std::thread::sleep(Duration::from_millis(500));
    // The failed write's batch to the resumed node was not executed: its stripes still hold
    // A (those on the node that answered hold B), and nothing is mixed within a stripe.
    let data = fs::read(m.path("f")).unwrap_or_else(|e| {
        panic!(
            "read after SIGCONT: {e}\n{}\nmn1: {}",
            fs::read_to_string(&m.log).unwrap_or_default(),
            c.nodes[1].as_ref().unwrap().stderr()
        )
    });
    let mut kept = 0;
    for (k, s) in data.chunks(1 << 16).enumerate() {
        assert!(s.iter().all(|&b| b == s[0]), "stripe {k} mixed");
        kept += usize::from(s[0] == b'A');
    }
    assert!(kept > 0, "the failed write landed on the resumed node");
    f.write_all_at(&vec![b'C'; STRIPES << 16], 0).unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![b'C'; STRIPES << 16]);
}

#[test]
fn a_stopped_primary_fails_namespace_operations_within_the_deadline_and_recovers() {
    let c = TestCluster::start(1, "64M");
    let m = Mount::new(&c, "attr_timeout=0,timeout=1");
    fs::write(m.path("before"), b"before").unwrap();
    let pid = c.nodes[0].as_ref().unwrap().child.id() as i32;
    // SAFETY: SIGSTOP to the memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // A namespace operation fails with EIO once the 1 s deadline passes, not never.
    let t0 = std::time::Instant::now();
    fails_with_eio_within("touch", &m.path("during"), Duration::from_secs(4));
    killable_while_blocked("stat", &m.path("other"));
    log_names(&m, "did not answer within", "mn0");
    // Stopped for longer than the mount's lock lease (4 s): the resumed primary must not
    // blame the mount for renewals it could not receive.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(t0.elapsed()));
    // SAFETY: SIGCONT to the same process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    // The mount serves again, on the same session, with its range locks.
    assert_eq!(fs::read(m.path("before")).unwrap(), b"before");
    fs::write(m.path("after"), b"after").unwrap();
    assert_eq!(fs::read(m.path("after")).unwrap(), b"after");
    std::thread::sleep(Duration::from_millis(300));
    fs::write(m.path("before"), b"again").unwrap();
    assert!(!fs::read_to_string(&m.log).unwrap().contains("fenced"));
}

/// A mount stopped (SIGSTOP) while it holds a range lock loses it once its lease runs out:
/// another mount's write to the range goes through within lease + margin; resumed, the stopped
/// mount's write fails with EIO, the range holds the other writer's bytes, the fenced mount
/// says why in its log, and it continues in a new session (its later writes land). Over tcp (the node refuses its batches) and
/// shm (the client's queue pair fences itself). The holder's write is slowed by a QoS limit so
/// the stop finds it holding the lock (waiting for tokens).
#[test]
fn a_stopped_lock_holder_is_fenced_after_its_lease_and_its_late_write_fails() {
    use std::time::Instant;
    let lease = Duration::from_millis(2000);
    let c = TestCluster::start_with(2, "64M", &["--lock-lease-ms", "2000"]);
    let other = Mount::new(&c, "");
    for transport in ["tcp", "shm"] {
        let holder = Mount::new(&c, &format!("transport={transport},limit=100"));
        let name = format!("f-{transport}");
        let len = 1usize << 20;
        fs::write(other.path(&name), vec![0u8; len]).unwrap();
        // A file the holder keeps open through the fence, unlinked elsewhere meanwhile.
        let kept_name = format!("kept-{transport}");
        fs::write(other.path(&kept_name), b"still here").unwrap();
        let kept = fs::File::open(holder.path(&kept_name)).unwrap();
        // 1 MiB = 256 tokens: about 2.5 s under limit=100, holding the range lock throughout.
        let path = holder.path(&name);
        let late = std::thread::spawn(move || {
            let f = OpenOptions::new().write(true).open(path).unwrap();
            f.write_all_at(&vec![0xAA; len], 0)
        });
        std::thread::sleep(Duration::from_millis(400));
        let pid = holder.child.id() as i32;
        rackfs_tests::stop_process(pid);
        let t0 = Instant::now();
        let f = OpenOptions::new()
            .write(true)
            .open(other.path(&name))
            .unwrap();
        f.write_all_at(&vec![0xBB; len], 0).unwrap();
        fs::remove_file(other.path(&kept_name)).unwrap();
        let took = t0.elapsed();
        // SAFETY: signalling the mount process this test started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        eprintln!("{transport}: the other mount's write waited {took:?} for a stopped holder (lease {lease:?})");
        assert!(
            took >= lease / 2,
            "{transport}: the other write did not wait ({took:?}): the holder held no lock"
        );
        assert!(
            took < lease + Duration::from_secs(4),
            "{transport}: the stopped holder kept its lock for {took:?}"
        );
        let err = late
            .join()
            .unwrap()
            .expect_err("the fenced holder's write must fail");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{transport}: {err}");
        let data = fs::read(other.path(&name)).unwrap();
        assert!(
            data.len() == len && data.iter().all(|&b| b == 0xBB),
            "{transport}: the range is not the other writer's: {} bytes of 0xAA",
            data.iter().filter(|&&b| b == 0xAA).count()
        );
        let fresh = Mount::new(&c, "transport=tcp");
        assert_eq!(fs::read(fresh.path(&name)).unwrap(), data);
        // The fenced mount continues in a new session: its next writes land, with locks.
        let after = holder.path(&format!("after-{transport}"));
        let t0 = Instant::now();
        assert!(
            wait_for(Duration::from_secs(10), || fs::write(
                &after,
                b"new session"
            )
            .is_ok()),
            "{transport}: the fenced mount did not continue in a new session"
        );
        eprintln!(
            "{transport}: writes through the fenced mount worked again after {:?}",
            t0.elapsed()
        );
        // The new session took over the fenced one's open files: the unlinked file lives on.
        let mut buf = [0u8; 10];
        kept.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(
            &buf, b"still here",
            "{transport}: an open file was freed by the fence"
        );
        drop(kept);
        f.write_all_at(b"other", 0).unwrap();
        let g = OpenOptions::new()
            .write(true)
            .open(holder.path(&name))
            .unwrap();
        g.write_all_at(b"HOLDER", 0).unwrap();
        drop(g); // an open file would keep the lazily unmounted mount alive
        assert_eq!(&fs::read(other.path(&name)).unwrap()[..6], b"HOLDER");
        assert_eq!(
            fs::read(other.path(&format!("after-{transport}"))).unwrap(),
            b"new session"
        );
        let log = fs::read_to_string(&holder.log).unwrap();
        assert!(
            log.contains("fenced") && log.contains("continues under a new session"),
            "{transport}: the log does not tell of the fence and the new session:\n{log}"
        );
        drop(holder);
        // The primary logged the fence, naming the session.
        assert!(c.nodes[0]
            .as_ref()
            .unwrap()
            .stderr()
            .contains("mount fenced on every memory node that is up"));
    }
}

/// A directory a mount made is held whole (issue 25): that mount answers lookups of names it
/// does not know there itself (the kernel's lookup before a create costs no round trip, see
/// `rpc_counts.rs`), yet sees at once a name another mount makes there, by any kind of
/// creation (the primary pushes it first; the directory is then shared and no longer held).
/// Stopped past its `attr_timeout`, it holds up another mount's create once, by that long,
/// and once resumed sees what was made meanwhile.
#[test]
fn names_another_mount_makes_in_a_directory_held_whole_are_seen_at_once() {
    let c = TestCluster::start(1, "64M");
    let a = Mount::new(&c, "attr_timeout=2");
    let b = Mount::new(&c, "attr_timeout=30,transport=tcp");
    let seen = |n: &str| fs::symlink_metadata(a.path(n)).is_ok();
    type Make<'a> = &'a dyn Fn(&std::path::Path);
    let kinds: [(&str, Make); 5] = [
        ("create", &|p| fs::write(p, b"1").unwrap()),
        ("mkdir", &|p| fs::create_dir(p).unwrap()),
        ("link", &|p| fs::hard_link(b.path("file"), p).unwrap()),
        ("symlink", &|p| {
            std::os::unix::fs::symlink("file", p).unwrap()
        }),
        ("rename", &|p| {
            fs::write(b.path("moved"), b"2").unwrap();
            fs::rename(b.path("moved"), p).unwrap()
        }),
    ];
    fs::write(b.path("file"), b"0").unwrap();
    for (kind, make) in kinds {
        fs::create_dir_all(a.path(&format!("{kind}/sub"))).unwrap();
        for n in ["x", "sub/x"] {
            let n = format!("{kind}/{n}");
            assert!(!seen(&n), "{n} before it exists");
            make(&b.path(&n));
            assert!(seen(&n), "{n}: {kind} seen");
        }
    }
    assert_eq!(fs::read(a.path("create/x")).unwrap(), b"1");

    fs::create_dir(a.path("late")).unwrap();
    assert!(!seen("late/x"));
    let pid = a.child.id() as i32;
    // SAFETY: signalling a child process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let t0 = std::time::Instant::now();
    fs::write(b.path("late/x"), b"4").unwrap();
    let waited = t0.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        waited < Duration::from_secs(10),
        "waited {waited:?} for a stopped mount"
    );
    assert!(
        seen("late/x"),
        "made while the mount was stopped, seen after"
    );
    assert_eq!(fs::read(a.path("late/x")).unwrap(), b"4");
}

/// A mount answers the names and attributes it learnt without asking the primary while its
/// watcher's lease runs (issue 25), yet shows what another mount did as a mount without any
/// cache does (`attr_timeout=0`): a size or mtime a write moved once its kernel's own cache
/// lapsed (it reads the file's record), a chmod or an unlink at once (pushed), the blocks a
/// last close trimmed.
#[test]
fn attributes_a_mount_answers_itself_follow_another_mounts_changes() {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;
    let c = TestCluster::start(1, "64M");
    let a = Mount::new(&c, "attr_timeout=1");
    let b = Mount::new(&c, "attr_timeout=1,transport=tcp");
    let truth = Mount::new(&c, "attr_timeout=0");
    let lapse = || std::thread::sleep(Duration::from_millis(1100));
    let same = |what: &str| {
        let (x, t) = (
            fs::metadata(a.path("f")).unwrap(),
            fs::metadata(truth.path("f")).unwrap(),
        );
        let view = |m: &fs::Metadata| (m.len(), m.mtime(), m.mtime_nsec(), m.mode(), m.blocks());
        assert_eq!(view(&x), view(&t), "{what}: (size, mtime, mode, blocks)");
    };
    let mut f = fs::File::create(b.path("f")).unwrap();
    f.write_all(b"hello").unwrap();
    same("created");
    lapse();
    same("learnt, then lapsed");
    f.write_all(b" world").unwrap();
    lapse();
    same("grown");
    std::thread::sleep(Duration::from_millis(20));
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(b"J").unwrap();
    lapse();
    same("overwritten in place");
    fs::set_permissions(
        b.path("f"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    same("chmod");
    drop(f);
    lapse();
    same("closed");
    fs::remove_file(b.path("f")).unwrap();
    assert!(fs::metadata(a.path("f")).is_err(), "unlink seen at once");
}
