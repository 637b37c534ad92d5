//! POSIX behaviour through a real mount, with the errno Linux users expect.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::process::Command;
use std::time::{Duration, SystemTime};

use rackfs_tests::{Mount, TestCluster};

fn errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

fn setup() -> (TestCluster, Mount) {
    let c = TestCluster::start(2, "32M");
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,allow_other");
    (c, m)
}

#[test]
fn files_directories_and_their_errors() {
    let (_c, m) = setup();
    let p = |s: &str| m.path(s);
    // create, O_EXCL, write, read back, stat
    fs::write(p("a"), b"hello world").unwrap();
    assert_eq!(fs::read(p("a")).unwrap(), b"hello world");
    let e = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(p("a"))
        .unwrap_err();
    assert_eq!(errno(e), libc::EEXIST);
    assert_eq!(errno(File::open(p("missing")).unwrap_err()), libc::ENOENT);
    let md = fs::metadata(p("a")).unwrap();
    assert_eq!((md.len(), md.nlink(), md.uid(), md.gid()), (11, 1, 0, 0));
    assert!(md.is_file());

    // O_TRUNC
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(p("a"))
        .unwrap()
        .write_all(b"xy")
        .unwrap();
    assert_eq!(fs::read(p("a")).unwrap(), b"xy");

    // directories
    fs::create_dir(p("d")).unwrap();
    assert_eq!(errno(fs::create_dir(p("d")).unwrap_err()), libc::EEXIST);
    fs::write(p("d/f"), b"1").unwrap();
    assert_eq!(errno(fs::remove_dir(p("d")).unwrap_err()), libc::ENOTEMPTY);
    assert_eq!(errno(fs::remove_file(p("d")).unwrap_err()), libc::EISDIR);
    assert_eq!(errno(fs::remove_dir(p("a")).unwrap_err()), libc::ENOTDIR);
    assert_eq!(
        errno(fs::create_dir(p("a/sub")).unwrap_err()),
        libc::ENOTDIR
    );
    assert_eq!(
        errno(OpenOptions::new().write(true).open(p("d")).unwrap_err()),
        libc::EISDIR
    );
    assert_eq!(fs::metadata(p("d")).unwrap().nlink(), 2);
    fs::create_dir(p("d/e")).unwrap();
    assert_eq!(fs::metadata(p("d")).unwrap().nlink(), 3);
    let long = "x".repeat(256);
    assert_eq!(
        errno(fs::write(p(&long), b"").unwrap_err()),
        libc::ENAMETOOLONG
    );
    fs::write(p(&"y".repeat(255)), b"ok").unwrap();

    // rename: overwrite, across directories, directories, into itself
    fs::write(p("b"), b"bbb").unwrap();
    fs::rename(p("b"), p("a")).unwrap();
    assert_eq!(fs::read(p("a")).unwrap(), b"bbb");
    assert_eq!(errno(fs::metadata(p("b")).unwrap_err()), libc::ENOENT);
    fs::rename(p("a"), p("d/e/a2")).unwrap();
    assert_eq!(fs::read(p("d/e/a2")).unwrap(), b"bbb");
    fs::create_dir(p("empty")).unwrap();
    fs::create_dir(p("full")).unwrap();
    fs::write(p("full/x"), b"").unwrap();
    fs::rename(p("empty"), p("d/e/moved")).unwrap();
    assert_eq!(
        errno(fs::rename(p("d"), p("d/e/inside")).unwrap_err()),
        libc::EINVAL
    );
    fs::create_dir(p("target")).unwrap();
    assert_eq!(
        errno(fs::rename(p("d"), p("full")).unwrap_err()),
        libc::ENOTEMPTY
    );
    fs::rename(p("d"), p("target")).unwrap(); // over an empty directory
    assert_eq!(fs::read(p("target/f")).unwrap(), b"1");
    assert_eq!(
        errno(fs::rename(p("full/x"), p("target")).unwrap_err()),
        libc::EISDIR
    );
    assert_eq!(
        errno(fs::rename(p("target"), p("full/x")).unwrap_err()),
        libc::ENOTDIR
    );

    // symlinks and hard links
    std::os::unix::fs::symlink("target/f", p("ln")).unwrap();
    assert_eq!(
        fs::read_link(p("ln")).unwrap().to_str().unwrap(),
        "target/f"
    );
    assert_eq!(fs::read(p("ln")).unwrap(), b"1");
    assert!(fs::symlink_metadata(p("ln"))
        .unwrap()
        .file_type()
        .is_symlink());
    fs::hard_link(p("target/f"), p("hard")).unwrap();
    assert_eq!(fs::metadata(p("hard")).unwrap().nlink(), 2);
    assert_eq!(
        fs::metadata(p("hard")).unwrap().ino(),
        fs::metadata(p("target/f")).unwrap().ino()
    );
    fs::remove_file(p("target/f")).unwrap();
    assert_eq!(fs::metadata(p("hard")).unwrap().nlink(), 1);
    assert_eq!(fs::read(p("hard")).unwrap(), b"1");
    assert_eq!(
        errno(fs::hard_link(p("target"), p("dirlink")).unwrap_err()),
        libc::EPERM
    );
}

#[test]
fn attributes_permissions_and_times() {
    let (_c, m) = setup();
    let f = m.path("f");
    fs::write(&f, b"data").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(&f, Some(1234), Some(5678)).unwrap();
    let md = fs::metadata(&f).unwrap();
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_times(fs::FileTimes::new().set_accessed(t).set_modified(t))
        .unwrap();
    let md = fs::metadata(&f).unwrap();
    assert_eq!((md.mtime(), md.atime()), (1_000_000_000, 1_000_000_000));
    // A write moves mtime forward.
    std::os::unix::fs::chown(&f, Some(0), Some(0)).unwrap();
    OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .write_all(b"x")
        .unwrap();
    assert!(fs::metadata(&f).unwrap().mtime() > 1_000_000_000);

    // Permission checks for another user (the mount allows other users).
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(m.dir.as_path(), fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |cmd: &str| {
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "sh",
                "-c",
                cmd,
            ])
            .output()
            .unwrap()
    };
    let out = as_nobody(&format!("cat {}", f.display()));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    let out = as_nobody(&format!("touch {}/new", m.dir.display()));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    let out = as_nobody(&format!("chown 65534 {}", f.display()));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "{out:?}"
    );
    fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
    let out = as_nobody(&format!("cat {}", f.display()));
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn unlink_while_open_keeps_data_until_last_close() {
    let (c, m) = setup();
    let f = m.path("victim");
    let data = vec![7u8; 300 << 10];
    fs::write(&f, &data).unwrap();
    let used_with_file = c.control(0).stats().unwrap().used + c.control(1).stats().unwrap().used;
    let mut h = File::open(&f).unwrap();
    fs::remove_file(&f).unwrap();
    assert_eq!(errno(fs::metadata(&f).unwrap_err()), libc::ENOENT);
    let mut back = Vec::new();
    h.read_to_end(&mut back).unwrap();
    assert_eq!(back, data, "readable after unlink while open");
    drop(h);
    // After the last close the memory comes back (after the quarantine).
    let freed = rackfs_tests::wait_for(Duration::from_secs(5), || {
        c.control(0).stats().unwrap().used + c.control(1).stats().unwrap().used < used_with_file
    });
    assert!(freed, "memory returned after the last close");
}

#[test]
fn truncate_returns_memory_and_holes_read_as_zeros() {
    let (c, m) = setup();
    let f = m.path("big");
    let used =
        |c: &TestCluster| c.control(0).stats().unwrap().used + c.control(1).stats().unwrap().used;
    let base = used(&c);
    let h = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&f)
        .unwrap();
    h.write_all_at(&vec![1u8; 4 << 20], 0).unwrap();
    let full = used(&c);
    assert!(
        full >= base + (4 << 20),
        "4 MiB of stripes allocated: {base} -> {full}"
    );
    h.set_len(100_000).unwrap();
    assert!(
        rackfs_tests::wait_for(Duration::from_secs(5), || used(&c) < base + (1 << 20)),
        "truncate gives stripes back"
    );
    // Growing again reads zeros past the old end, including inside the kept stripe.
    h.set_len(1 << 20).unwrap();
    let mut buf = vec![9u8; 1 << 20];
    h.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf[..100_000].iter().all(|&b| b == 1));
    assert!(buf[100_000..].iter().all(|&b| b == 0));
    // A sparse write far away allocates only its stripe.
    h.write_all_at(b"end", (1 << 30) - 3).unwrap();
    assert_eq!(h.metadata().unwrap().len(), 1 << 30);
    assert!(used(&c) < base + (2 << 20));
    let mut z = vec![1u8; 4096];
    h.read_exact_at(&mut z, 512 << 20).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    // EFBIG beyond the maximum file size.
    assert_eq!(
        errno(h.write_all_at(b"x", 1 << 46).unwrap_err()),
        libc::EFBIG
    );
    assert_eq!(errno(h.set_len((1 << 46) + 1).unwrap_err()), libc::EFBIG);
}

#[test]
fn full_cluster_is_enospc_and_loses_nothing() {
    let c = TestCluster::start(2, "4M");
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    fs::write(m.path("keep"), b"precious").unwrap();
    let mut f = File::create(m.path("fill")).unwrap();
    let chunk = vec![3u8; 256 << 10];
    let mut written = 0u64;
    let err = loop {
        match f.write_all(&chunk) {
            Ok(()) => written += chunk.len() as u64,
            Err(e) => break e,
        }
        assert!(written < 64 << 20, "a 8 MiB cluster cannot take 64 MiB");
    };
    assert_eq!(errno(err), libc::ENOSPC);
    assert_eq!(
        fs::read(m.path("keep")).unwrap(),
        b"precious",
        "other files are intact"
    );
    drop(f);
    fs::remove_file(m.path("fill")).unwrap();
    // The freed space is in quarantine; a write that needs it waits for it instead of
    // failing.
    fs::write(m.path("again"), vec![1u8; 1 << 20]).expect("space in quarantine is waited for");
    assert_eq!(fs::read(m.path("again")).unwrap(), vec![1u8; 1 << 20]);
}

#[test]
fn thousands_of_small_files_fit_where_their_bytes_fit() {
    // 2 x 16 MiB and the default 1 MiB stripe unit: with a stripe per file, 32 files fit.
    // One replica: the memory per copy is what is measured (two copies take twice it).
    let c = TestCluster::start(2, "16M");
    let m = Mount::new(&c, "attr_timeout=0,replicas=1");
    let used =
        |c: &TestCluster| c.control(0).stats().unwrap().used + c.control(1).stats().unwrap().used;
    let base = used(&c);
    let mut rng = rackfs_tests::Rng(13);
    let d = m.path("tree");
    fs::create_dir(&d).unwrap();
    let mut files = Vec::new();
    let mut stored = 0u64;
    for i in 0..3000 {
        let len = 1 + rng.below(8192) as usize;
        let data = rng.bytes(len);
        let p = d.join(format!("f{i}"));
        if i % 3 == 0 {
            // Written in pieces, as tar and editors do: the extent grows.
            let mut f = File::create(&p).unwrap();
            for chunk in data.chunks(1000) {
                f.write_all(chunk).unwrap();
            }
        } else {
            fs::write(&p, &data).unwrap_or_else(|e| panic!("file {i} of small files: {e}"));
        }
        stored += data.len() as u64;
        files.push((p, data));
    }
    for (p, data) in &files {
        assert_eq!(&fs::read(p).unwrap(), data, "{}", p.display());
    }
    let dram = used(&c) - base;
    eprintln!(
        "{} files, {stored} bytes stored, {dram} bytes of node memory ({:.2}x)",
        files.len(),
        dram as f64 / stored as f64
    );
    assert!(
        dram <= stored + stored / 2,
        "{dram} bytes of node memory for {stored} bytes of small files"
    );
    // st_blocks counts the memory a file holds, not whole stripes.
    let md = fs::metadata(&files[1].0).unwrap();
    assert!(md.blocks() * 512 < md.len() + 4096, "{md:?}");
}

#[test]
fn readdir_lists_thousands_and_offsets_are_stable() {
    let (_c, m) = setup();
    let d = m.path("many");
    fs::create_dir(&d).unwrap();
    for i in 0..2000 {
        File::create(d.join(format!("f{i:04}"))).unwrap();
    }
    let mut names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 2000);
    assert_eq!(names[1999], "f1999");

    // Reading while others change the directory: entries present throughout are seen exactly once.
    let mut it = fs::read_dir(&d).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..500 {
        seen.insert(it.next().unwrap().unwrap().file_name());
    }
    for i in 0..100 {
        fs::remove_file(d.join(format!("f{i:04}"))).ok();
        File::create(d.join(format!("new{i}"))).unwrap();
    }
    for e in it {
        let n = e.unwrap().file_name();
        assert!(seen.insert(n.clone()), "{n:?} listed twice");
    }
    for i in 100..2000 {
        assert!(
            seen.contains(std::ffi::OsStr::new(&format!("f{i:04}"))),
            "f{i:04} skipped"
        );
    }
}

#[test]
fn statfs_reports_cluster_capacity() {
    let (_c, m) = setup();
    let out = Command::new("stat")
        .args(["-f", "-c", "%S %b %f"])
        .arg(&m.dir)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    let v: Vec<u64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[0], 4096);
    // Two 32 MiB nodes, each keeping a sixteenth of its region for the metadata area; every
    // 64 KiB stripe has a copy on each, in an extent with a 64-byte tag: 479 stripes fit.
    let per_node = (32 << 20) * 15 / 16 / ((64 << 10) + 64);
    assert_eq!(
        v[0] * v[1],
        per_node * (64 << 10),
        "two 32 MiB nodes, two replicas"
    );
    assert!(v[2] <= v[1]);
}

#[test]
fn append_and_errors_on_bad_handles() {
    let (_c, m) = setup();
    let f = m.path("log");
    let mut a = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&f)
        .unwrap();
    a.write_all(b"one\n").unwrap();
    // Another writer extends the file behind this handle's back: appends go to the real end.
    OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .write_all_at(b"two\n", 4)
        .unwrap();
    a.write_all(b"three\n").unwrap();
    assert_eq!(fs::read_to_string(&f).unwrap(), "one\ntwo\nthree\n");
    let e = File::open(&f).unwrap().write_all(b"x").unwrap_err();
    assert_eq!(errno(e), libc::EBADF);
}

#[test]
fn special_files_and_fifo() {
    let (_c, m) = setup();
    let out = Command::new("mkfifo").arg(m.path("pipe")).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &fs::metadata(m.path("pipe")).unwrap().file_type()
    ));
}

/// Writes one byte at the start of `path` as user and group 65534 (nobody).
fn write_as_nobody(path: &std::path::Path) {
    use std::os::unix::process::CommandExt;
    let out = Command::new("dd")
        .args([
            "if=/dev/zero",
            "bs=1",
            "count=1",
            "conv=notrunc",
            "status=none",
        ])
        .arg(format!("of={}", path.display()))
        .uid(65534)
        .gid(65534)
        .output()
        .expect("dd");
    assert!(
        out.status.success(),
        "dd as nobody: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_write_by_another_user_clears_setuid_and_setgid() {
    // pjdfstest chmod/12: what an unprivileged writer leaves of the set-ID bits.
    let c = TestCluster::start(1, "64M");
    let m = Mount::new(&c, "allow_other");
    for (before, after) in [
        (0o4777, 0o777),  // set-user-ID goes
        (0o2777, 0o777),  // set-group-ID with group execute goes
        (0o6777, 0o777),  // both
        (0o2767, 0o2767), // set-group-ID without group execute stays (not an executable)
        (0o777, 0o777),
    ] {
        let p = m.path(&format!("setid-{before:o}"));
        fs::write(&p, b"x").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(before)).unwrap();
        write_as_nobody(&p);
        let mode = fs::metadata(&p).unwrap().mode() & 0o7777;
        assert_eq!(mode, after, "mode {before:o} after a write by nobody");
    }
    // A write by root (CAP_FSETID) keeps them.
    let p = m.path("setid-root");
    fs::write(&p, b"x").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o6777)).unwrap();
    OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .write_all_at(b"y", 0)
        .unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o6777);
}

fn fallocate(f: &File, mode: i32, offset: u64, len: u64) -> Result<(), i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on an open descriptor.
    match unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, len as i64) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)),
    }
}

/// fallocate reserves memory now (ENOSPC at the fallocate, not at a later write), keeps or
/// grows the size as asked, punches holes that give memory back, zeroes ranges, and refuses
/// what it does not support.
#[test]
fn fallocate_reserves_early_punches_holes_and_zeroes_ranges() {
    let c = TestCluster::start(2, "16M");
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    let used =
        |c: &TestCluster| c.control(0).stats().unwrap().used + c.control(1).stats().unwrap().used;
    let open = |name: &str| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(m.path(name))
            .unwrap()
    };
    let base = used(&c);
    let r = open("reserved");
    fallocate(&r, 0, 0, 4 << 20).unwrap();
    assert_eq!(
        r.metadata().unwrap().len(),
        4 << 20,
        "mode 0 grows the size"
    );
    assert!(
        used(&c) >= base + (8 << 20),
        "4 MiB on two replicas reserved at once"
    );
    // KEEP_SIZE reserves past the end without growing the size, and the reservation outlives
    // a close (the trim at close keeps it).
    let k = open("keep");
    k.write_all_at(b"small", 0).unwrap();
    fallocate(&k, libc::FALLOC_FL_KEEP_SIZE, 0, 48 << 10).unwrap();
    assert_eq!(k.metadata().unwrap().len(), 5);
    drop(k);
    let blocks = fs::metadata(m.path("keep")).unwrap().blocks();
    assert!(
        blocks * 512 >= 2 * (48 << 10),
        "{blocks} blocks after close"
    );

    // Fill the cluster: the reserved file still takes its 4 MiB, a new reservation is ENOSPC.
    let mut fill = File::create(m.path("fill")).unwrap();
    let chunk = vec![3u8; 256 << 10];
    while fill.write_all(&chunk).is_ok() {}
    r.write_all_at(&vec![7u8; 4 << 20], 0)
        .expect("writes into reserved memory succeed on a full cluster");
    assert_eq!(fallocate(&open("late"), 0, 0, 4 << 20), Err(libc::ENOSPC));
    assert_eq!(fs::read(m.path("reserved")).unwrap(), vec![7u8; 4 << 20]);

    // Punch 1 MiB (whole stripes) plus a partial stripe: those bytes read zeros, the size
    // stays, and the whole stripes' memory goes back.
    let before = r.metadata().unwrap().blocks();
    let on_nodes = used(&c);
    // Stripes the full cluster placed with one replica get their second copy as soon as the
    // punch makes room (the primary's re-replication): that memory is taken again.
    let rebuilt = |c: &TestCluster| c.control(0).stats().unwrap().health.rebuilt_bytes;
    let rebuilt_before = rebuilt(&c);
    let (off, len) = (100_000u64, (1 << 20) + 30_000);
    fallocate(
        &r,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        off,
        len,
    )
    .unwrap();
    let after = r.metadata().unwrap().blocks();
    assert!(
        (before - after) * 512 >= 2 * (15 << 16),
        "punching 15 whole stripes frees them on both replicas: {before} -> {after} blocks"
    );
    assert!(
        rackfs_tests::wait_for(Duration::from_secs(5), || used(&c) + 2 * (15 << 16)
            <= on_nodes + (rebuilt(&c) - rebuilt_before)),
        "the nodes get the punched stripes back once out of quarantine ({} bytes used, {} \
         before, {} re-replicated since)",
        used(&c),
        on_nodes,
        rebuilt(&c) - rebuilt_before
    );
    let mut want = vec![7u8; 4 << 20];
    want[off as usize..(off + len) as usize].fill(0);
    assert_eq!(fs::read(m.path("reserved")).unwrap(), want);
    assert_eq!(r.metadata().unwrap().len(), 4 << 20);
    // Zero a range across the end: zeros inside, the size grows to its end.
    fallocate(&r, libc::FALLOC_FL_ZERO_RANGE, (4 << 20) - 10, 110).unwrap();
    want[(4 << 20) - 10..].fill(0);
    want.resize((4 << 20) + 100, 0);
    assert_eq!(fs::read(m.path("reserved")).unwrap(), want);

    // What RackFS does not support, and bad ranges, get their errors and change nothing.
    assert_eq!(
        fallocate(&r, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 64 << 10),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(
        fallocate(&r, libc::FALLOC_FL_INSERT_RANGE, 0, 64 << 10),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(
        fallocate(&r, libc::FALLOC_FL_PUNCH_HOLE, 0, 10),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(fallocate(&r, 0, 0, 0), Err(libc::EINVAL));
    assert_eq!(fallocate(&r, 0, 1 << 46, 1), Err(libc::EFBIG));
    assert_eq!(fs::read(m.path("reserved")).unwrap(), want);
}

/// A RackFS file takes no ioctl: the answer is `ENOTTY`, what `isatty` expects of a file, and
/// the mount logs nothing for it (Python asks on every `open`; each used to log a warning).
#[test]
fn an_ioctl_is_enotty_and_logs_nothing() {
    use std::os::fd::AsRawFd;
    let (_c, m) = setup();
    let f = std::fs::File::create(m.path("tty?")).unwrap();
    let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
    for _ in 0..3 {
        // SAFETY: TCGETS writes at most one termios into the buffer given; `f` is open.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::TCGETS, termios.as_mut_ptr()) };
        assert_eq!(r, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOTTY)
        );
    }
    // SAFETY: isatty reads no memory of ours; `f` is open.
    assert_eq!(unsafe { libc::isatty(f.as_raw_fd()) }, 0);
    let log = m.log_text();
    assert!(!log.contains("ioctl"), "the mount logged an ioctl:\n{log}");
}
