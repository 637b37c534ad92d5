//! `rackfs up` survives the kill -9 of any of its memory nodes, the primary included, with its
//! defaults: its coordinator lives in the `rackfs up` process, a standby follows the primary,
//! and a dead node is started again, empty, and rejoins (issue 26, item 1). Through the real
//! binaries: two mounts, fio verify writing on one, kill -9 of a data node, then of the
//! primary, then of the new primary once it has a standby again.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rackfs_tests::{bin_path, wait_for, Fio, Mount, TempDir, TestCluster};

/// Holds the other tests of this file off: each kills and stops nodes on timers of a lease
/// or two, and two clusters under faults at once on a small machine starve each other into
/// faults the test did not make.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn rackfs(args: &[&str]) -> std::process::Output {
    Command::new(bin_path("rackfs"))
        .args(args)
        .output()
        .unwrap()
}

/// A cluster under faults: `rackfs up`'s, or one built by hand on etcd.
trait Faulted {
    /// The first mount's directory.
    fn dir(&self) -> PathBuf;
    /// Where a second mount finds the cluster, and the secret file.
    fn source(&self) -> (String, PathBuf);
    /// `rackfs status` of the cluster.
    fn status(&self) -> String;
    /// The pid of node `name`'s process.
    fn pid(&self, name: &str) -> i32;
    /// Kills node `name` with SIGKILL; returns once it runs again, empty.
    fn kill(&mut self, name: &str);
    /// After a pause of a node: starts again the one that exited (a deposed primary does),
    /// as a unit's restart policy would; `rackfs up` does that itself.
    fn revive(&mut self) {}
    /// The nodes' warnings and errors, for a failure's message (`rackfs up` prints its own
    /// logs when it is dropped).
    fn warnings(&self) -> String {
        String::new()
    }

    /// Waits until the cluster is whole again: `nodes` up, a standby in sync, every stripe at
    /// its replicas; returns the primary's and the standby's names.
    fn healed(&self, nodes: usize) -> (String, String) {
        let mut last = String::new();
        let whole = wait_for(Duration::from_secs(60), || {
            last = self.status();
            // A node's row: its name, then its address and figures (or DOWN).
            let rows = last.lines().filter(|l| {
                let l = l.trim_start();
                l.starts_with("mn") && l.split_whitespace().count() > 3
            });
            let down = last.contains("DOWN") || last.contains("DEGRADED");
            rows.count() >= nodes
                && !down
                && last.contains("(in sync; takes over if the primary dies)")
                && last.contains("data: healthy")
                && last.contains(" 0 degraded")
        });
        assert!(
            whole,
            "the cluster did not heal within 60 s:\n{last}\n{}",
            self.warnings()
        );
        let word_after = |key: &str| {
            let at = last.find(key).unwrap() + key.len();
            let w = last[at..].split([' ', ')', ':']).next().unwrap();
            w.trim().to_string()
        };
        (word_after("(primary "), word_after("metadata standby: "))
    }
}

/// One `rackfs up` instance: its mount point and state directory.
struct Up {
    dir: PathBuf,
    inst: PathBuf,
    _tmp: TempDir,
}

impl Up {
    /// `nodes` nodes, the coordinator in `rackfs up` or (`etcd`) in a local etcd.
    fn start(nodes: u32, etcd: bool) -> Up {
        let tmp = TempDir::new("upfail");
        let dir = tmp.path().join("m");
        let n = nodes.to_string();
        let d = dir.to_str().unwrap();
        let mut args = vec!["up", d, "--detach", "--nodes", &n, "--region", "256M"];
        if etcd {
            args.push("--etcd");
        }
        let out = rackfs(&args);
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        let coordinator = if etcd {
            "coordinator : etcd at"
        } else {
            "coordinator : in this process"
        };
        assert!(text.contains(coordinator), "{text}");
        let inst = rackfs_cli::up::instance_dir(&fs::canonicalize(&dir).unwrap());
        Up {
            dir,
            inst,
            _tmp: tmp,
        }
    }

    fn state(&self, key: &str) -> String {
        let s = rackfs_cli::up::read_state(&self.inst).expect("rackfs up's state");
        rackfs_cli::up::state_value(&s, key).unwrap_or_default()
    }
}

impl Faulted for Up {
    fn dir(&self) -> PathBuf {
        self.dir.clone()
    }

    fn source(&self) -> (String, PathBuf) {
        (
            self.state("primary"),
            PathBuf::from(self.state("secret_file")),
        )
    }

    /// `rackfs status` of this cluster, found among its nodes' current addresses.
    fn status(&self) -> String {
        let (addrs, secret) = (self.state("primary"), self.state("secret_file"));
        let out = rackfs(&["status", "--cluster", &addrs, "--secret-file", &secret]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The pid of node `name`'s process (its command line names its own socket in the
    /// instance; others may name it too, to join it).
    fn pid(&self, name: &str) -> i32 {
        let sock = self.inst.join(format!("{name}.sock"));
        let sock = format!("--shm-socket {}", sock.display());
        for e in fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains("rackfs-memnode") && cmd.contains(&sock) {
                return pid;
            }
        }
        panic!("no process of {name} ({sock})");
    }

    /// Kills node `name` with SIGKILL and waits until `rackfs up` started it again.
    fn kill(&mut self, name: &str) {
        // How many times it came back: `comebacks=` lists them in node order.
        let id: usize = name.trim_start_matches("mn").parse().unwrap();
        let events = || -> u32 {
            let back = self.state("comebacks");
            back.split(',')
                .nth(id)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0)
        };
        let before = events();
        let pid = self.pid(name);
        // SAFETY: kill(2) of a memory node this test's `rackfs up` started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        assert!(
            wait_for(Duration::from_secs(30), || events() > before),
            "{name} was not started again within 30 s"
        );
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // What went wrong, before `down` removes the logs: rackfs up's, and the nodes'
            // warnings.
            let dir = fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
            let tag = rackfs_fs::mount::path_tag(&dir);
            let up_log = rackfs_fs::mount::state_dir().join(format!("up-{tag}.log"));
            eprintln!("--- {}", up_log.display());
            eprintln!("{}", fs::read_to_string(&up_log).unwrap_or_default());
            for n in 0..4 {
                let log = self.inst.join(format!("mn{n}.log"));
                let text = fs::read_to_string(&log).unwrap_or_default();
                eprintln!("--- {} (warnings)", log.display());
                for l in text.lines().filter(|l| !l.contains(" INFO ")) {
                    eprintln!("{l}");
                }
            }
        }
        if std::thread::panicking() && std::env::var_os("RACKFS_KEEP_ON_FAILURE").is_some() {
            eprintln!(
                "kept for a look (RACKFS_KEEP_ON_FAILURE): {}",
                self.dir.display()
            );
            return;
        }
        let _ = rackfs(&["down", self.dir.to_str().unwrap()]);
    }
}

/// Each of `files` reads back as written, through its own mount and through `second`.
fn unchanged(files: &[(PathBuf, Vec<u8>)], second: &Mount) {
    for (p, data) in files {
        assert!(fs::read(p).unwrap() == *data, "{} changed", p.display());
        let other = second.path(p.file_name().unwrap().to_str().unwrap());
        let got = fs::read(&other).unwrap();
        assert!(got == *data, "{} changed", other.display());
    }
}

/// Files of known content, for comparing after the kills.
fn write_files(dir: &Path, tag: &str) -> Vec<(PathBuf, Vec<u8>)> {
    (0..4u8)
        .map(|i| {
            let len = 300_000 * (i as usize + 1) + 17;
            let data: Vec<u8> = (0..len).map(|k| (k * 31 + i as usize * 7) as u8).collect();
            let p = dir.join(format!("{tag}-{i}"));
            fs::write(&p, &data).unwrap();
            (p, data)
        })
        .collect()
}

#[test]
fn rackfs_up_survives_a_data_node_its_primary_and_the_next_primary() {
    let _alone = alone();
    three_kills(Up::start(3, false));
}

#[test]
fn rackfs_up_on_etcd_survives_a_data_node_its_primary_and_the_next_primary() {
    let _alone = alone();
    three_kills(Up::start(3, true));
}

/// Kills a data node, then the primary, then the new primary, each once the cluster healed
/// from the last, under fio verify on one mount while another mount follows.
fn three_kills(mut up: Up) {
    let secret = PathBuf::from(up.state("secret_file"));
    let second = Mount::try_new(&up.state("primary"), &secret, "").expect("a second mount");
    let before = write_files(&up.dir, "before");
    let (primary, standby) = up.healed(3);
    // fio writes and verifies (crc32c) on the first mount through all three kills.
    let mut fio = Fio::verify("upfail", &up.dir, "randwrite", "48M")
        .opt("time_based", 1)
        .opt("runtime", 150)
        .opt("verify_backlog", 256)
        .spawn();
    std::thread::sleep(Duration::from_secs(2));

    let data_node = ["mn0", "mn1", "mn2"]
        .into_iter()
        .find(|n| *n != primary && *n != standby)
        .unwrap();
    up.kill(data_node);
    let (p1, _) = up.healed(3);
    assert_eq!(p1, primary, "a data node's death moves no primary");
    up.kill(&primary);
    let (p2, s2) = up.healed(3);
    assert_ne!(p2, primary, "the standby took over");
    assert_ne!(s2, p2);
    up.kill(&p2);
    let (p3, _) = up.healed(3);
    // (It may be the first primary, started again empty and made the standby since.)
    assert_ne!(p3, p2, "the new standby took over");

    assert!(fio.running(), "fio ended early: {:?}", fio.finish());
    fio.interrupt();
    let report = fio.finish().expect("fio verify through three kills");
    assert_eq!(report.first().error, 0, "{report:?}");
    // It wrote throughout: well over what it did before the first kill.
    assert!(report.first().write.io_bytes > 8 << 20, "{report:?}");

    // Every file is identical from both mounts; new files can be made from either.
    unchanged(&before, &second);
    fs::write(second.path("after-second"), b"from the second mount").unwrap();
    assert_eq!(
        fs::read(up.dir.join("after-second")).unwrap(),
        b"from the second mount"
    );
    fs::write(up.dir.join("after-first"), b"from the first").unwrap();
    assert_eq!(
        fs::read(second.path("after-first")).unwrap(),
        b"from the first"
    );

    // `rackfs status` says what happened.
    let all = String::from_utf8_lossy(&rackfs(&["status"]).stdout).into_owned();
    for name in [data_node, primary.as_str(), p2.as_str()] {
        assert!(all.contains(&format!("{name} exited")), "{all}");
        assert!(all.contains(&format!("{name} is back")), "{all}");
    }
}

/// The bytes of file `f` of grower `t` from offset `from` on.
fn grown(t: usize, f: usize, from: usize, len: usize) -> Vec<u8> {
    (from..from + len)
        .map(|k| (k * 13 + t * 101 + f * 7 + k / 4093) as u8)
        .collect()
}

/// Sizes a grown file passes through: its first stripe starts small and moves to a larger
/// extent at each step (a move the primary makes, then journals to its standby).
const GROWTH: [usize; 5] = [100, 5_000, 20_000, 70_000, 250_000];

/// Files a grower keeps (it checks and removes older ones, so the cluster never fills).
const KEPT: usize = 6;

/// What one grower did.
struct Grown {
    /// The files it kept, with their acknowledged bytes.
    kept: Vec<(PathBuf, Vec<u8>)>,
    errors: Vec<String>,
    /// How many files it grew.
    files: usize,
}

/// Grows files `g{t}-{f}` through [`GROWTH`], each write appended, until `stop`.
fn grow(dir: &Path, t: usize, stop: &std::sync::atomic::AtomicBool) -> Grown {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    let (mut files, mut errors) = (std::collections::VecDeque::new(), Vec::new());
    let mut f = 0;
    while !stop.load(Ordering::Relaxed) && errors.is_empty() {
        let p = dir.join(format!("g{t}-{f}"));
        let mut have = Vec::new();
        for &size in &GROWTH {
            let more = grown(t, f, have.len(), size - have.len());
            let res = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .and_then(|mut h| h.write_all(&more));
            match res {
                Ok(()) => have.extend(more),
                Err(e) => {
                    errors.push(format!("{}: growing to {size}: {e}", p.display()));
                    break;
                }
            }
        }
        files.push_back((p, have));
        if files.len() > KEPT {
            let (old, data) = files.pop_front().unwrap();
            match fs::read(&old) {
                Ok(got) if got == data => {}
                Ok(got) => errors.push(format!("{}: {}", old.display(), difference(&got, &data))),
                Err(e) => errors.push(format!("{}: {e}", old.display())),
            }
            if let Err(e) = fs::remove_file(&old) {
                errors.push(format!("{}: remove: {e}", old.display()));
            }
        }
        f += 1;
    }
    Grown {
        kept: files.into(),
        errors,
        files: f,
    }
}

/// Where `got` differs from `want`, for a failure message.
fn difference(got: &[u8], want: &[u8]) -> String {
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    let Some(at) = first else {
        return format!("{} bytes instead of {}", got.len(), want.len());
    };
    let run = got[at..]
        .iter()
        .zip(&want[at..])
        .take_while(|(a, b)| a != b)
        .count();
    let zeros = got[at..at + run].iter().all(|&b| b == 0);
    format!(
        "{run} bytes differ from offset {at} (of {}; zeros: {zeros}); {} bytes in all",
        want.len(),
        got.len()
    )
}

/// Files grow (their first stripe moved to larger extents, one step after another, on four
/// threads) while the primary is killed, twice: a move the old primary made but its standby
/// never had is followed by the new primary. Before, such a stripe listed its tombstoned
/// extents: the growing write failed with EIO, and the file read EIO for ever. It also
/// found, one run in five: bytes blank past the first stripe's old capacity (a last close
/// reaching the new primary before the writer's size report trimmed the stripe to the
/// mirror's size); writes to a data node not yet joined to the new primary failing for good
/// (the mount's map had lost the node); a range-lock wait spinning in the dead primary's
/// tree for a minute (its memory stays mapped over shm).
#[test]
fn files_growing_while_the_primary_dies_read_back_whole() {
    let _alone = alone();
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut up = Up::start(3, false);
    let (mut primary, _) = up.healed(3);
    let mut all = Vec::new();
    for round in 0..2 {
        let stop = Arc::new(AtomicBool::new(false));
        let growers: Vec<_> = (0..4)
            .map(|t| {
                let (dir, stop) = (up.dir.join(format!("r{round}")), stop.clone());
                fs::create_dir_all(&dir).unwrap();
                std::thread::spawn(move || grow(&dir, t, &stop))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1500));
        up.kill(&primary);
        // Until the growers' calls went through the new primary.
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        // All of them end before any is judged (a grower still writing would keep the mount
        // busy when the cluster is taken down).
        let grown: Vec<Grown> = growers.into_iter().map(|g| g.join().unwrap()).collect();
        for g in grown {
            assert!(g.errors.is_empty(), "round {round}: {:?}", g.errors);
            assert!(
                g.files > 2 * KEPT,
                "round {round}: only {} files grown",
                g.files
            );
            all.extend(g.kept);
        }
        primary = up.healed(3).0;
    }
    for (p, data) in &all {
        let got = fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(
            got == *data,
            "{} changed ({} bytes, {} written)",
            p.display(),
            got.len(),
            data.len()
        );
    }
}

/// A primary paused past the mounts' lock lease (4 s) but within their calls' deadline (5 s)
/// answers, as it resumes, the lease renewal its pause held up. Its standby took over
/// meanwhile, so it must not tell the mount it was fenced: the mount goes on with the new
/// primary, and the write that waited on the paused one succeeds there.
#[test]
fn a_primary_paused_past_the_lock_lease_fails_no_operation() {
    let _alone = alone();
    let up = Up::start(2, false);
    let (primary, _) = up.healed(2);
    fs::write(up.dir.join("before"), b"before").unwrap();
    let pid = up.pid(&primary);
    // SAFETY: kill(2) of a memory node this test's `rackfs up` started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let dir = up.dir.clone();
    let during = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        fs::write(dir.join("during"), b"during")
    });
    std::thread::sleep(Duration::from_millis(4500));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let written = during.join().unwrap();
    assert!(
        written.is_ok(),
        "a write waiting on the paused primary: {written:?}"
    );
    assert_eq!(fs::read(up.dir.join("during")).unwrap(), b"during");
    fs::write(up.dir.join("after"), b"after").unwrap();
    assert_eq!(fs::read(up.dir.join("before")).unwrap(), b"before");
    up.healed(2);
}

/// A primary paused for about its lease (1.8 to 2.35 s, twelve times): each time it either keeps
/// its lease with the coordinator, or its standby takes over. Kept, it refuses data for a
/// moment after it resumes, until it renewed its own lease: operations that met it then are
/// run again, not failed (before, fio verify failed with EIO about one pause in thirty).
///
/// Not in CI: about one run in three (session 24) a pause of 2.05 s past a take-over the run
/// made earlier ended with the standby taking over on a mirror where the fio file's stripes had
/// no live replica but the old primary's, whose death lost them (`unavailable=16`). Not
/// reproduced since (session 26: 27 runs, about 200 take-overs, here and with every pause near
/// the lease). A candidate cause is fixed: a standby installed a snapshot the primary had given
/// up on over the newer one it sent next, undoing the re-replications between them
/// (`standby_state::a_late_older_snapshot_leaves_the_newer_mirror`). Pauses of 2 s and less
/// never showed the failure the retry fixes.
#[test]
#[ignore = "a take-over after a take-over can find stripes only on the old primary (unexplained)"]
fn a_primary_paused_for_about_its_lease_fails_no_data_operation() {
    let _alone = alone();
    let up = Up::start(3, false);
    up.healed(3);
    let before = write_files(&up.dir, "before");
    fs::create_dir(up.dir.join("v")).unwrap();
    let mut fio = Fio::verify("paused", &up.dir.join("v"), "randwrite", "16M")
        .opt("time_based", 1)
        .opt("runtime", 600)
        .opt("verify_backlog", 128)
        .spawn();
    for round in 0..12u64 {
        let (primary, _) = up.healed(3);
        let ms = 1800 + round * 50;
        let pid = up.pid(&primary);
        // SAFETY: kill(2) of a memory node this test's `rackfs up` started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(ms));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(2000));
        assert!(
            fio.running(),
            "fio ended after the primary's pause of {ms} ms: {:?}",
            fio.finish()
        );
    }
    up.healed(3);
    fio.interrupt();
    let report = fio.finish().expect("fio verify through the pauses");
    assert_eq!(report.first().error, 0, "{report:?}");
    for (p, data) in &before {
        assert!(fs::read(p).unwrap() == *data, "{} changed", p.display());
    }
}

/// Record `seq` of appender `t`: a header, then filler of a length that varies.
fn record(t: usize, seq: usize) -> Vec<u8> {
    let len = 20 + (seq * 977 + t * 131) % 3000;
    let mut r = format!("{t}:{seq}:{len}|").into_bytes();
    r.extend((0..len).map(|k| b'a' + ((k + seq + t) % 26) as u8));
    r.push(b'\n');
    r
}

/// Records each appender of [`appends_in_flight_when_the_primary_dies_land_once`] writes at
/// most, and its pause after each: at most 1.5 MB/s and 30 MB a thread, so the file (twice,
/// with its replicas) stays well inside the cluster's 720 MiB however fast the machine. (Unpaced,
/// a fast machine filled the cluster: its degraded stripes had nowhere to be copied.)
const APPENDS: usize = 20_000;
const APPEND_PACE: Duration = Duration::from_millis(1);

/// O_APPEND writes of four threads to one file (and a fifth opening and closing it, so the
/// primary journals its size meanwhile) while the primary is killed, twice: each record the
/// application was told is written is in the file exactly once, whole. A write in flight at
/// the kill is written again once, where its first attempt went if the new primary's size
/// covers that, else at the end of file. (Once, under heavy load, a record read back blank
/// past its first 46 bytes, before last closes were kept from trimming to a size the writing
/// mount had not reported yet.)
#[test]
fn appends_in_flight_when_the_primary_dies_land_once() {
    let _alone = alone();
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut up = Up::start(3, false);
    let (mut primary, _) = up.healed(3);
    let log = up.dir.join("appended.log");
    fs::write(&log, b"").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let appenders: Vec<_> = (0..4)
        .map(|t| {
            let (log, stop) = (log.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut h = fs::OpenOptions::new().append(true).open(&log).unwrap();
                let mut seq = 0;
                while !stop.load(Ordering::Relaxed) && seq < APPENDS {
                    h.write_all(&record(t, seq))
                        .map_err(|e| format!("{t}:{seq}: {e}"))?;
                    seq += 1;
                    std::thread::sleep(APPEND_PACE);
                }
                Ok::<usize, String>(seq)
            })
        })
        .collect();
    let closer = {
        let (log, stop) = (log.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                drop(fs::File::open(&log));
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(1500));
        up.kill(&primary);
        std::thread::sleep(Duration::from_secs(3));
        primary = up.healed(3).0;
    }
    stop.store(true, Ordering::Relaxed);
    closer.join().unwrap();
    let written: Vec<usize> = appenders
        .into_iter()
        .map(|a| a.join().unwrap().expect("every append succeeds"))
        .collect();
    let got = fs::read(&log).unwrap();
    let mut seen = std::collections::HashMap::new();
    for line in got.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let text = String::from_utf8_lossy(line);
        let mut head = text.splitn(4, [':', '|']);
        let (t, seq) = match (head.next(), head.next()) {
            (Some(t), Some(s)) => (t.parse::<usize>(), s.parse::<usize>()),
            _ => panic!("a torn record: {text:.80}"),
        };
        let (t, seq) = (
            t.expect("a record's thread"),
            seq.expect("a record's number"),
        );
        let at = line.as_ptr() as usize - got.as_ptr() as usize;
        assert!(
            [line, b"\n"].concat() == record(t, seq),
            "record {t}:{seq} at offset {at} of {} is not whole: {}",
            got.len(),
            difference(&[line, b"\n"].concat(), &record(t, seq))
        );
        *seen.entry((t, seq)).or_insert(0) += 1;
    }
    for (t, &n) in written.iter().enumerate() {
        assert!(n > 50, "appender {t} wrote only {n} records");
        for seq in 0..n {
            assert_eq!(seen.get(&(t, seq)), Some(&1), "record {t}:{seq} (of {n})");
        }
    }
    assert_eq!(
        seen.len(),
        written.iter().sum::<usize>(),
        "records nobody wrote"
    );
}

/// Whether a chaos failure shows the logs whole (`RACKFS_CHAOS_VERBOSE=1`), not just their
/// warnings.
fn verbose() -> bool {
    std::env::var_os("RACKFS_CHAOS_VERBOSE").is_some()
}

/// How many faults [`faults_on_random_nodes_lose_nothing`] injects: `RACKFS_CHAOS_FAULTS`, or
/// 6 (CI; the long runs in the note used 30 and more).
fn chaos_faults() -> usize {
    std::env::var("RACKFS_CHAOS_FAULTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

/// A bounded chaos run through real processes (issue 26, item 2): four nodes under `rackfs
/// up`, two mounts, fio verify writing on both and a create/rename/compare/unlink loop; one
/// fault at a time on a random node, the primary included, once the cluster healed from the
/// last: kill -9 (started again, empty) or SIGSTOP for one to three leases. No application
/// error, no byte changed.
#[test]
fn faults_on_random_nodes_lose_nothing() {
    let _alone = alone();
    chaos(&mut Up::start(4, false));
}

/// The same chaos on a cluster built by hand on etcd (four `rackfs-memnode` processes with
/// fixed command lines, as units would have, node 0's with `--primary`), restarted by the
/// test.
#[test]
fn faults_on_random_nodes_of_a_cluster_on_etcd_lose_nothing() {
    let _alone = alone();
    let c = TestCluster::on_etcd(4, "256M", &["--node-lease-ms", "2000"]);
    let first = Mount::new(&c, "");
    chaos(&mut OnEtcd { c, first });
}

/// A cluster on etcd whose dead nodes the test starts again (with their own command lines).
struct OnEtcd {
    c: TestCluster,
    first: Mount,
}

impl Faulted for OnEtcd {
    fn dir(&self) -> PathBuf {
        self.first.path("")
    }

    fn source(&self) -> (String, PathBuf) {
        (self.addrs(), self.c.secret_file.clone())
    }

    fn status(&self) -> String {
        let secret = self.c.secret_file.to_str().unwrap();
        let out = rackfs(&[
            "status",
            "--cluster",
            &self.addrs(),
            "--secret-file",
            secret,
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn pid(&self, name: &str) -> i32 {
        let i: usize = name.trim_start_matches("mn").parse().unwrap();
        self.c.nodes[i].as_ref().expect("node running").child.id() as i32
    }

    fn kill(&mut self, name: &str) {
        let i: usize = name.trim_start_matches("mn").parse().unwrap();
        self.c.kill(i);
        // Once its lease lapsed, as a unit's restart policy would.
        std::thread::sleep(Duration::from_millis(2500));
        self.c.restart(i);
    }

    fn warnings(&self) -> String {
        let mut out = "--- the first mount\n".to_string();
        for l in self.first.log_text().lines() {
            if verbose() || !l.contains(" INFO ") {
                out += l;
                out.push('\n');
            }
        }
        for i in 0..self.c.nodes.len() {
            out += &format!("--- mn{i} (warnings, over all its runs)\n");
            for l in self.c.log(i).lines() {
                if !verbose() && l.contains(" INFO ") {
                    continue;
                }
                out += l;
                out.push('\n');
            }
        }
        out
    }

    fn revive(&mut self) {
        let exited = |c: &mut TestCluster| {
            let dead = c.nodes.iter_mut().position(|n| {
                n.as_mut()
                    .is_some_and(|n| !matches!(n.child.try_wait(), Ok(None)))
            });
            dead.inspect(|&i| c.kill(i))
        };
        // A deposed primary notices within a renewal of resuming, and exits.
        std::thread::sleep(Duration::from_millis(1500));
        while let Some(i) = exited(&mut self.c) {
            eprintln!("mn{i} exited after its pause: started again");
            std::thread::sleep(Duration::from_millis(2500));
            self.c.restart(i);
        }
    }
}

impl OnEtcd {
    fn addrs(&self) -> String {
        let live = self.c.nodes.iter().flatten().map(|n| n.tcp.clone());
        live.collect::<Vec<_>>().join(",")
    }
}

/// Runs the chaos on `cluster` (four nodes): a second mount, files of known content, fio
/// verify on both mounts and the namespace loop on the second, then the faults.
fn chaos(cluster: &mut dyn Faulted) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("chaos seed {seed} (faults: {})", chaos_faults());
    let mut rng = rackfs_tests::Rng(seed);
    let dir = cluster.dir();
    let (source, secret) = cluster.source();
    let second = Mount::try_new(&source, &secret, "").expect("a second mount");
    let before = write_files(&dir, "before");
    fs::create_dir(dir.join("a")).unwrap();
    fs::create_dir(dir.join("b")).unwrap();
    fs::create_dir(dir.join("names")).unwrap();
    cluster.healed(4);
    let fio = |name: &str, dir: PathBuf| {
        Fio::verify(name, &dir, "randwrite", "24M")
            .opt("time_based", 1)
            .opt("runtime", 1800)
            .opt("verify_backlog", 128)
            .spawn()
    };
    let mut fio_a = fio("chaos-a", dir.join("a"));
    let mut fio_b = fio("chaos-b", second.path("b"));
    // The namespace loop, on the second mount.
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let names = second.path("names");
    let loop_thread = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        let mut rng = rackfs_tests::Rng(seed ^ 0x5eed);
        std::thread::spawn(move || -> Result<(), String> {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let len = 1 + rng.below(64 << 10) as usize;
                let data = rng.bytes(len);
                let (t, u) = (names.join(format!("t{i}")), names.join(format!("u{i}")));
                let mut f =
                    fs::File::create(&t).map_err(|e| format!("create {}: {e}", t.display()))?;
                f.write_all(&data).map_err(|e| {
                    format!("write {} bytes to new {}: {e}", data.len(), t.display())
                })?;
                drop(f);
                fs::rename(&t, &u).map_err(|e| format!("rename to {}: {e}", u.display()))?;
                let back = fs::read(&u).map_err(|e| format!("read {}: {e}", u.display()))?;
                if back != data {
                    return Err(format!("{} {}", u.display(), differs(&back, &data)));
                }
                fs::remove_file(&u).map_err(|e| format!("unlink {}: {e}", u.display()))?;
                rounds.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok(())
        })
    };
    for fault in 0..chaos_faults() {
        let (primary, standby) = cluster.healed(4);
        let name = format!("mn{}", rng.below(4));
        let role = match name {
            _ if name == primary => " (the primary)",
            _ if name == standby => " (the standby)",
            _ => "",
        };
        let lease_ms = 2000;
        if rng.below(2) == 0 {
            eprintln!("fault {fault}: kill -9 {name}{role}");
            cluster.kill(&name);
        } else {
            let ms = lease_ms / 2 + rng.below(3 * lease_ms);
            eprintln!("fault {fault}: SIGSTOP {name}{role} for {ms} ms");
            let pid = cluster.pid(&name);
            // SAFETY: kill(2) of a memory node this test's `rackfs up` started.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            std::thread::sleep(Duration::from_millis(ms));
            // SAFETY: as above (a node that exited meanwhile ignores it).
            unsafe { libc::kill(pid, libc::SIGCONT) };
            // A resumed primary that was deposed answers as the primary for a moment before it
            // exits: the cluster is judged healed only once that is over (one fault at a time).
            std::thread::sleep(Duration::from_millis(lease_ms));
            cluster.revive();
        }
        let warnings = || failure_logs(&second, cluster);
        if !fio_a.running() {
            panic!(
                "fio a ended at fault {fault}: {:?}\n{}",
                fio_a.finish(),
                warnings()
            );
        }
        if !fio_b.running() {
            panic!(
                "fio b ended at fault {fault}: {:?}\n{}",
                fio_b.finish(),
                warnings()
            );
        }
        if loop_thread.is_finished() {
            let end = loop_thread.join();
            panic!(
                "the namespace loop ended at fault {fault}: {end:?}\n{}",
                warnings()
            );
        }
    }
    cluster.healed(4);
    stop.store(true, Ordering::Relaxed);
    fio_a.interrupt();
    fio_b.interrupt();
    for f in [fio_a, fio_b] {
        let report = f.finish().expect("fio verify through the faults");
        let logs = || failure_logs(&second, cluster);
        assert_eq!(report.first().error, 0, "{report:?}\n{}", logs());
    }
    loop_thread.join().unwrap().expect("the namespace loop");
    assert!(rounds.load(Ordering::Relaxed) > 0);
    // Near misses: operations of the namespace loop's mount that went through only after
    // retrying for a second or more (one that retries past its patience fails the run).
    for l in second.log_text().lines() {
        if l.contains("after retrying") {
            eprintln!("second mount: {l}");
        }
    }
    unchanged(&before, &second);
}

/// The mounts' and nodes' warnings (whole logs with `RACKFS_CHAOS_VERBOSE`), for a failure.
fn failure_logs(second: &Mount, cluster: &dyn Faulted) -> String {
    let log = second.log_text();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| verbose() || !l.contains(" INFO "))
        .collect();
    format!(
        "the second mount's warnings:\n{}\n{}",
        warned.join("\n"),
        cluster.warnings()
    )
}

/// How `back` differs from `wrote`: the lengths, and the first and last differing byte with
/// the runs of zeros `back` has there (a lost stripe write reads zeros, a stale one old bytes).
fn differs(back: &[u8], wrote: &[u8]) -> String {
    let diff: Vec<usize> = (0..back.len().min(wrote.len()))
        .filter(|&i| back[i] != wrote[i])
        .collect();
    let zeros = diff.iter().filter(|&&i| back[i] == 0).count();
    format!(
        "read back {} bytes of the {} written; {} differ (first at {:?}, last at {:?}), {zeros} of them zeros",
        back.len(),
        wrote.len(),
        diff.len(),
        diff.first(),
        diff.last()
    )
}
