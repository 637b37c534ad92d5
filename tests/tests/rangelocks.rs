//! Range locks through real mounts: concurrent appends and overlapping writes from two mounts,
//! a lock tree kept by a busy writer and given back to another mount,
//! a lock holder killed with SIGKILL (recovered) or only stopped (keeps its lock), and the lock
//! tree growing with a 64 GiB sparse file and shrinking with ftruncate.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rackfs_locks::{Geometry, LockTree};
use rackfs_tests::{bin_path, wait_for, Mount, Rng, TestCluster};

const RECORD: usize = 100;

fn record(mount: usize, thread: usize, seq: usize) -> Vec<u8> {
    let mut r = format!("mount {mount} thread {thread} record {seq:06} ").into_bytes();
    r.resize(RECORD - 1, b'.');
    r.push(b'\n');
    r
}

#[test]
fn appends_from_two_mounts_never_overwrite_each_other() {
    let c = TestCluster::start(2, "64M");
    let mounts = [Mount::new(&c, ""), Mount::new(&c, "transport=tcp")];
    std::fs::write(mounts[0].path("log"), b"").unwrap();
    let per_thread = 150;
    std::thread::scope(|s| {
        for (mi, m) in mounts.iter().enumerate() {
            for t in 0..2 {
                let path = m.path("log");
                s.spawn(move || {
                    let mut f = OpenOptions::new().append(true).open(path).unwrap();
                    for seq in 0..per_thread {
                        f.write_all(&record(mi, t, seq)).unwrap();
                    }
                });
            }
        }
    });
    let data = std::fs::read(mounts[1].path("log")).unwrap();
    assert_eq!(data.len(), 4 * per_thread * RECORD, "every append landed");
    let mut seen = HashSet::new();
    for (i, chunk) in data.chunks(RECORD).enumerate() {
        assert!(
            seen.insert(chunk.to_vec()),
            "record {i} appears twice: {:?}",
            String::from_utf8_lossy(chunk)
        );
    }
    for mi in 0..2 {
        for t in 0..2 {
            for seq in 0..per_thread {
                assert!(seen.contains(&record(mi, t, seq)), "lost {mi}/{t}/{seq}");
            }
        }
    }
}

#[test]
fn overlapping_writes_from_two_mounts_never_mix_a_unit() {
    let c = TestCluster::start(2, "64M");
    let mounts = [Mount::new(&c, ""), Mount::new(&c, "transport=tcp")];
    let units = 64u64;
    std::fs::write(mounts[0].path("shared"), vec![0u8; (units * 4096) as usize]).unwrap();
    std::thread::scope(|s| {
        for (mi, m) in mounts.iter().enumerate() {
            for t in 0..2u64 {
                let path = m.path("shared");
                s.spawn(move || {
                    let f = OpenOptions::new().write(true).open(path).unwrap();
                    let mut rng = Rng(0xabcd + mi as u64 * 10 + t);
                    for seq in 0..200u64 {
                        // Aligned ranges of 1 to 8 units, each write with its own stamp.
                        let l = rng.below(units);
                        let n = (1 + rng.below(8)).min(units - l);
                        let stamp =
                            ((mi as u32) << 24 | (t as u32) << 16 | (seq as u32 + 1)).to_le_bytes();
                        let buf: Vec<u8> = stamp
                            .iter()
                            .cycle()
                            .take((n * 4096) as usize)
                            .copied()
                            .collect();
                        f.write_all_at(&buf, l * 4096).unwrap();
                    }
                });
            }
        }
    });
    let data = std::fs::read(mounts[1].path("shared")).unwrap();
    for (u, unit) in data.chunks(4096).enumerate() {
        let first = &unit[..4];
        assert!(
            unit.chunks(4).all(|w| w == first),
            "unit {u} holds bytes of two different writes"
        );
    }
}

/// A `rackfs-lock-holder` holding `range` of `file`, once it says so.
fn hold(c: &TestCluster, file: &str, range: &str) -> Child {
    let mut child = Command::new(bin_path("rackfs-lock-holder"))
        .args(["--cluster", &c.addr(), "--transport", "shm", "--file", file])
        .args(["--range", range, "--secret-file"])
        .arg(&c.secret_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn lock holder");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "held");
    child
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// Starts a 4 KiB write at `offset` on another thread; the flag says when it returned.
fn write_in_background(m: &Mount, file: &str, offset: u64) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let (d, path) = (done.clone(), m.path(file));
    std::thread::spawn(move || {
        let f = OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(&[7u8; 4096], offset).unwrap();
        d.store(true, Ordering::SeqCst);
    });
    done
}

#[test]
fn a_killed_lock_holder_is_recovered_and_a_stopped_one_keeps_its_lock() {
    let c = TestCluster::start(1, "64M");
    let m = Mount::new(&c, "");
    std::fs::write(m.path("f"), vec![1u8; 1 << 20]).unwrap();

    // A holder that releases normally: the write waits for it, then goes through.
    let mut h = hold(&c, "f", "0:inf");
    let done = write_in_background(&m, "f", 8192);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !done.load(Ordering::SeqCst),
        "the write waits for the holder"
    );
    drop(h.stdin.take()); // release
    assert!(wait_for(Duration::from_secs(10), || done.load(Ordering::SeqCst)));
    h.wait().unwrap();

    // A holder that is stopped keeps its lock; killed, it is recovered.
    let mut h = hold(&c, "f", "0:16");
    let done = write_in_background(&m, "f", 4096);
    signal(&h, libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !done.load(Ordering::SeqCst),
        "a stopped holder keeps its lock"
    );
    let killed = Instant::now();
    h.kill().unwrap();
    h.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || done.load(Ordering::SeqCst)),
        "the write proceeds once the dead holder's locks are recovered"
    );
    println!(
        "write went through {:?} after the holder was killed",
        killed.elapsed()
    );
    assert!(c.control(0).stats().unwrap().lock_recoveries >= 1);
    // Unlocked ranges were never blocked, and the data is whole.
    let f = std::fs::read(m.path("f")).unwrap();
    assert_eq!(&f[4096..8192 + 4096], &[7u8; 8192][..]);
    assert!(f[..4096].iter().chain(&f[12288..]).all(|&b| b == 1));
}

#[test]
fn the_lock_tree_grows_with_a_sparse_64_gib_file_and_shrinks_with_ftruncate() {
    let c = TestCluster::start(1, "64M");
    let m = Mount::new(&c, "");
    let stats = || c.control(0).stats().unwrap();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("sparse"))
        .unwrap();
    f.write_all_at(&[1u8; 4096], 0).unwrap();
    let small = stats();
    let t = Instant::now();
    let end = 64u64 << 30;
    f.write_all_at(&[2u8; 4096], end - 4096).unwrap();
    println!(
        "write at 64 GiB (with the tree's scale-up) took {:?}",
        t.elapsed()
    );
    let big = stats();
    let tall = LockTree::memory_len(Geometry::for_units(end / 4096));
    assert!(
        big.lock_trees >= small.lock_trees + tall,
        "a tree covering 64 GiB ({tall} B) is published: {} -> {} B",
        small.lock_trees,
        big.lock_trees
    );
    assert_eq!(f.metadata().unwrap().len(), end);
    // Shrink: the tall tree goes back to the node once its grace is over.
    f.set_len(8192).unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || {
            let s = stats();
            s.lock_trees < tall && s.used + tall <= big.used
        }),
        "ftruncate returns the lock tree's memory: {:?}",
        stats().lock_trees
    );
    let mut buf = [0u8; 4096];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, [1u8; 4096]);
    // Writes after the shrink work and grow it again as needed.
    f.write_all_at(&[3u8; 4096], 1 << 30).unwrap();
    f.read_exact_at(&mut buf, 1 << 30).unwrap();
    assert_eq!(buf, [3u8; 4096]);
}

/// Atomic verbs (CAS, FAA and their masked forms) node `i` has executed.
fn atomics(c: &TestCluster, i: usize) -> u64 {
    c.control(i).stats().expect("node stats").verbs.ops[2..6]
        .iter()
        .sum()
}

/// A mount writing a file on its own keeps the file's lock tree (its writes then take no
/// atomic on the primary), and gives it back as soon as another mount wants a range: the
/// other mount's overlapping writes complete while the first keeps writing, and no unit mixes
/// the two.
#[test]
fn a_tree_kept_by_a_busy_writer_is_given_back_to_another_mount() {
    let c = TestCluster::start(2, "64M");
    let a = Mount::new(&c, "qos=off");
    let b = Mount::new(&c, "qos=off,transport=tcp");
    let units = 16u64;
    std::fs::write(a.path("kept"), vec![0u8; (units * 4096) as usize]).unwrap();
    let fa = OpenOptions::new().write(true).open(a.path("kept")).unwrap();
    let write = |f: &std::fs::File, who: u8, seq: u64| {
        let stamp = [who, (seq >> 16) as u8, (seq >> 8) as u8, seq as u8];
        let buf: Vec<u8> = stamp.iter().cycle().take(4096 * 4).copied().collect();
        f.write_all_at(&buf, (seq % (units - 3)) * 4096).unwrap();
    };
    for seq in 0..20 {
        write(&fa, 1, seq);
    }
    let before = atomics(&c, 0);
    for seq in 20..220 {
        write(&fa, 1, seq);
    }
    let kept_atomics = atomics(&c, 0) - before;
    assert!(
        kept_atomics < 50,
        "200 uncontended writes took {kept_atomics} atomics on the primary: the tree was not kept"
    );
    let b_done = AtomicBool::new(false);
    let a_writes = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            // Keeps writing until the other mount is done (at most 60 s).
            let started = Instant::now();
            let mut seq = 220;
            while !b_done.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(60) {
                write(&fa, 1, seq);
                seq += 1;
            }
            (seq, b_done.load(Ordering::SeqCst))
        });
        let fb = OpenOptions::new().write(true).open(b.path("kept")).unwrap();
        for seq in 0..50 {
            write(&fb, 2, seq);
        }
        b_done.store(true, Ordering::SeqCst);
        writer.join().unwrap()
    });
    assert!(
        a_writes.1,
        "the other mount's writes did not get through while this one kept writing"
    );
    let data = std::fs::read(b.path("kept")).unwrap();
    for (u, unit) in data.chunks(4096).enumerate() {
        assert!(
            unit.chunks(4).all(|w| w == &unit[..4]),
            "unit {u} holds bytes of two different writes"
        );
    }
}
