//! `fcntl` record locks and `flock` across mounts: one table of scenarios is run by real
//! processes (`rackfs-locker`) first on tmpfs, all in one directory, then on RackFS with the
//! processes spread over two mounts (shm and tcp); the transcripts must be the same. Pids in
//! `F_GETLK` answers are named after the process they belong to.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rackfs_tests::{Locker, Mount, TempDir, TestCluster};

/// Runs `steps` with three processes whose file is `files[i]` (the same file, maybe through
/// different mounts); returns the transcript. A step is `P cmd` (answer awaited), `P cmd &`
/// (sent; its answer awaited later by `P wait`), `P blocked` (P has not answered within
/// 300 ms) or `P exit`.
fn run(files: [&Path; 3], steps: &[&str]) -> Vec<String> {
    let mut procs: Vec<Locker> = (0..3).map(|_| Locker::spawn()).collect();
    let names = ["A", "B", "C"];
    let mut transcript = Vec::new();
    for (i, p) in procs.iter_mut().enumerate() {
        p.send(&format!("open {}", files[i].display()));
        assert_eq!(p.answer(Duration::from_secs(10)).as_deref(), Some("ok"));
    }
    for step in steps {
        let (who, cmd) = step.split_once(' ').expect("step");
        let i = names.iter().position(|n| *n == who).expect("process");
        let p = &mut procs[i];
        let answer = match cmd {
            "blocked" => match p.answer(Duration::from_millis(300)) {
                None => "blocked".to_string(),
                Some(a) => format!("not blocked: {a}"),
            },
            "wait" => p
                .answer(Duration::from_secs(10))
                .unwrap_or_else(|| "no answer in 10 s".into()),
            "exit" => {
                p.exit();
                "exited".into()
            }
            c if c.ends_with(" &") => {
                p.send(c.trim_end_matches(" &"));
                "sent".into()
            }
            c => {
                p.send(c);
                p.answer(Duration::from_secs(10))
                    .unwrap_or_else(|| "no answer in 10 s".into())
            }
        };
        // Pids are named after their process.
        let mut words: Vec<String> = answer.split(' ').map(String::from).collect();
        if cmd.starts_with("getlk") && words.len() == 4 {
            let pid: u32 = words[3].parse().unwrap_or(0);
            words[3] = match procs.iter().position(|p| p.pid == pid) {
                Some(j) => format!("pid:{}", names[j]),
                None => format!("pid:other({})", pid != 0),
            };
        }
        let step = step.replace(&files[0].display().to_string(), "PATH");
        transcript.push(format!("{step} -> {}", words.join(" ")));
    }
    transcript
}

/// Each scenario: its name and steps. Processes A and C share the first mount, B the second.
const SCENARIOS: &[(&str, &[&str])] = &[
    (
        "conflicts and F_GETLK",
        &[
            "A setlk W 0 100",
            "B setlk W 50 10",
            "B setlk R 0 10",
            "B getlk W 0 1000",
            "B getlk R 100 5",
            "B setlk W 100 10",
            "C getlk R 0 0",
            "A setlk U 0 100",
            "B setlk W 0 100",
            "A getlk W 0 0",
        ],
    ),
    (
        "shared locks and to-EOF ranges",
        &[
            "A setlk R 10 0",
            "B setlk R 0 20",
            "C setlk R 1000000 1",
            "B setlk W 5 10",
            "B setlk W 0 10",
            "C getlk W 0 5",
            "C getlk R 12 3",
            "A setlk U 10 0",
            "C getlk W 0 0",
        ],
    ),
    (
        "split, merge, upgrade and downgrade",
        &[
            "A setlk W 0 100",
            "A setlk U 40 20",
            "B setlk W 45 10",
            "B getlk W 0 100",
            "A setlk W 100 50",
            "B getlk R 60 200",
            "A setlk R 0 40",
            "A setlk R 40 5",
            "B getlk W 0 50",
            "B setlk R 0 10",
            "A setlk W 0 10",
            "B setlk U 0 100",
            "A setlk W 0 10",
            "B getlk R 0 1",
        ],
    ),
    (
        "a close of any descriptor drops the process's locks",
        &[
            "A setlk W 0 10",
            "A open PATH",
            "A close",
            "B setlk W 0 10",
            "C setlk W 20 10",
            "C exit",
            "B setlk W 20 10",
        ],
    ),
    (
        "blocking, wake-up order and EINTR",
        &[
            "A setlk W 0 100",
            "B setlkw W 0 10 &",
            "C setlkw W 50 10 &",
            "B blocked",
            "C blocked",
            "A setlk U 0 20",
            "B wait",
            "C blocked",
            "A setlk U 0 100",
            "C wait",
            "A alarm 300",
            "A setlkw W 0 10",
            "A setlkw R 70 10",
        ],
    ),
    (
        "flock",
        &[
            "A flock ex",
            "B flock ex nb",
            "B flock sh nb",
            "A flock sh",
            "B flock sh nb",
            "C flock ex nb",
            "A flock un",
            "C flock ex nb",
            "B close",
            "C flock ex",
            "C flock ex nb",
            "A flock sh nb",
        ],
    ),
    (
        "open file description (OFD) locks",
        &[
            "A ofd-setlk W 0 10",
            "A open PATH",
            "A ofd-setlk W 5 10",
            "B ofd-setlkw W 0 5 &",
            "B blocked",
            "A use 0",
            "A close",
            "B wait",
            "A use 1",
            "A ofd-setlk W 5 10",
            "B ofd-setlk R 5 1",
        ],
    ),
    (
        "a forked child is another owner",
        &["A setlk W 0 10", "A fork-hold W 0 10", "B setlk R 0 1"],
    ),
];

fn scenarios(dirs: [&Path; 3]) -> Vec<String> {
    let mut out = Vec::new();
    for (k, (name, steps)) in SCENARIOS.iter().enumerate() {
        let file = format!("lock{k}");
        let files: Vec<PathBuf> = dirs.iter().map(|d| d.join(&file)).collect();
        let steps: Vec<String> = steps
            .iter()
            .map(|s| s.replace("PATH", &files[0].display().to_string()))
            .collect();
        let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
        out.push(format!("== {name}"));
        out.extend(run([&files[0], &files[1], &files[2]], &steps));
    }
    out
}

#[test]
fn lock_scenarios_on_two_mounts_match_tmpfs() {
    let local = TempDir::in_memory("locks");
    let want = scenarios([local.path(), local.path(), local.path()]);
    let c = TestCluster::start(2, "32M");
    let a = Mount::new(&c, "attr_timeout=0");
    let b = Mount::new(&c, "attr_timeout=0,transport=tcp");
    let got = scenarios([&a.dir, &b.dir, &a.dir]);
    let text = |v: &[String]| v.join("\n");
    assert_eq!(
        text(&got),
        text(&want),
        "RackFS (left) and tmpfs (right) differ"
    );
    // The scenarios do exercise conflicts, waits and interrupts.
    let all = text(&want);
    for seen in ["EAGAIN", "blocked", "EINTR", "W 0 100 pid:A"] {
        assert!(all.contains(seen), "no {seen} in the scenarios:\n{all}");
    }
    for unseen in ["no answer", "not blocked", "errno"] {
        assert!(
            !all.contains(unseen),
            "a scenario went wrong on tmpfs:\n{all}"
        );
    }
}

/// Takes `typ` on `[0, 10)` of `path` in a new locker process; panics unless granted.
fn holder(path: &Path, typ: &str) -> Locker {
    let mut p = Locker::spawn();
    for cmd in [
        format!("open {}", path.display()),
        format!("setlk {typ} 0 10"),
    ] {
        p.send(&cmd);
        assert_eq!(
            p.answer(Duration::from_secs(10)).as_deref(),
            Some("ok"),
            "{cmd}"
        );
    }
    p
}

/// How long a `F_SETLKW` of `[0, 10)` on `path` waits (it must be granted within `within`).
fn wait_for_lock(path: &Path, within: Duration) -> Duration {
    let mut p = Locker::spawn();
    p.send(&format!("open {}", path.display()));
    assert_eq!(p.answer(Duration::from_secs(10)).as_deref(), Some("ok"));
    let t0 = std::time::Instant::now();
    p.send("setlkw W 0 10");
    let got = p.answer(within);
    assert_eq!(got.as_deref(), Some("ok"), "not granted within {within:?}");
    t0.elapsed()
}

/// A mount killed holding a lock gives it up when its session ends; one stopped past its
/// lock lease is fenced and gives it up then (and its processes' locks are gone after).
#[test]
fn locks_of_a_killed_or_stopped_mount_are_released() {
    let lease = Duration::from_millis(2000);
    let c = TestCluster::start_with(2, "32M", &["--lock-lease-ms", "2000"]);
    let other = Mount::new(&c, "attr_timeout=0");

    // kill -9 of the mount holding a write lock.
    let mut victim = Mount::new(&c, "attr_timeout=0,transport=tcp");
    std::fs::write(other.path("k"), b"x").unwrap();
    let _held = holder(&victim.path("k"), "W");
    let waiter = {
        let path = other.path("k");
        std::thread::spawn(move || wait_for_lock(&path, Duration::from_secs(10)))
    };
    std::thread::sleep(Duration::from_millis(300));
    victim.child.kill().unwrap();
    let took = waiter.join().unwrap();
    eprintln!("a killed mount's lock was granted elsewhere {took:?} after the F_SETLKW");
    assert!(
        took >= Duration::from_millis(250),
        "the waiter did not wait: {took:?}"
    );

    // SIGSTOP of the mount holding a read lock, past its lease.
    let stopped = Mount::new(&c, "attr_timeout=0");
    std::fs::write(other.path("s"), b"x").unwrap();
    let _held = holder(&stopped.path("s"), "R");
    let pid = stopped.child.id() as i32;
    rackfs_tests::stop_process(pid);
    let took = wait_for_lock(&other.path("s"), lease + Duration::from_secs(5));
    // SAFETY: signalling the mount process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    eprintln!("a stopped mount's lock was granted elsewhere after {took:?} (lease {lease:?})");
    assert!(
        took >= lease / 2,
        "the stopped holder held no lock: {took:?}"
    );
}

/// Runs `sqlite3` on `db` with `sql` on stdin; returns its stdout.
fn sqlite(db: &Path, sql: String) -> std::process::Child {
    let mut c = Command::new("sqlite3")
        .arg(db)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sqlite3 (Debian's sqlite3 package)");
    let mut stdin = c.stdin.take().expect("stdin");
    std::thread::spawn(move || stdin.write_all(sql.as_bytes()));
    c
}

/// Two processes on two mounts write one SQLite database at once, each in its own
/// transactions (SQLite's locking is fcntl locks on the database and its journal): nothing
/// is lost and `PRAGMA integrity_check` finds nothing wrong.
#[test]
fn sqlite_from_two_mounts_never_corrupts() {
    let c = TestCluster::start(2, "64M");
    let a = Mount::new(&c, "");
    let b = Mount::new(&c, "transport=tcp");
    let setup = sqlite(
        &a.path("db"),
        "CREATE TABLE t(writer TEXT, n INTEGER, pad TEXT);".into(),
    )
    .wait_with_output()
    .unwrap();
    assert!(
        setup.status.success(),
        "{}",
        String::from_utf8_lossy(&setup.stderr)
    );
    const ROWS: usize = 300;
    let script = |who: &str| {
        let mut s = String::from(".timeout 30000\n");
        for n in 0..ROWS {
            // Each transaction reads what is there and adds a row that depends on it.
            s.push_str(&format!(
                "BEGIN IMMEDIATE; INSERT INTO t VALUES('{who}', {n}, \
                 (SELECT printf('%0500d', count(*)) FROM t)); COMMIT;\n"
            ));
        }
        s
    };
    let wa = sqlite(&a.path("db"), script("a"));
    let wb = sqlite(&b.path("db"), script("b"));
    for (who, w) in [("a", wa), ("b", wb)] {
        let out = w.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "writer {who}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let check = |m: &Mount| {
        let out = sqlite(
            &m.path("db"),
            "PRAGMA integrity_check; SELECT writer, count(*) FROM t GROUP BY writer; \
             SELECT count(DISTINCT pad) FROM t;"
                .into(),
        )
        .wait_with_output()
        .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Every row of both writers, each transaction seeing a different count of rows before it:
    // they were serialized.
    let want = format!("ok\na|{ROWS}\nb|{ROWS}\n{}\n", 2 * ROWS);
    assert_eq!(check(&a), want);
    assert_eq!(check(&b), want);
}
