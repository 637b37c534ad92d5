//! Extended attributes through real mounts: Linux's errors and limits, coherence across two
//! mounts, lifetime with the inode, and `cp -a` / `rsync -X` keeping them.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;

use rackfs_tests::TempDir;
use rackfs_tests::{Mount, TestCluster};

fn c(s: &[u8]) -> CString {
    CString::new(s).unwrap()
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn set(path: &Path, name: &str, value: &[u8], flags: i32) -> Result<(), i32> {
    let (p, n) = (c(path.as_os_str().as_bytes()), c(name.as_bytes()));
    // SAFETY: p and n are NUL-terminated and value outlives the call.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// `getxattr` into a buffer of `cap` bytes (0: ask for the length).
fn get_into(path: &Path, name: &str, cap: usize) -> Result<Vec<u8>, i32> {
    let (p, n) = (c(path.as_os_str().as_bytes()), c(name.as_bytes()));
    let mut buf = vec![0u8; cap];
    // SAFETY: buf has cap writable bytes; p and n are NUL-terminated.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), cap) };
    if r < 0 {
        return Err(last_errno());
    }
    buf.truncate(if cap == 0 { 0 } else { r as usize });
    if cap == 0 {
        buf.resize(r as usize, 0);
    }
    Ok(buf)
}

fn get(path: &Path, name: &str) -> Result<Vec<u8>, i32> {
    get_into(path, name, 1 << 16)
}

fn list(path: &Path) -> Result<Vec<String>, i32> {
    let p = c(path.as_os_str().as_bytes());
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: buf has its length in writable bytes; p is NUL-terminated.
    let r = unsafe { libc::listxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(last_errno());
    }
    let mut names: Vec<String> = buf[..r as usize]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    names.sort();
    Ok(names)
}

fn remove(path: &Path, name: &str) -> Result<(), i32> {
    let (p, n) = (c(path.as_os_str().as_bytes()), c(name.as_bytes()));
    // SAFETY: p and n are NUL-terminated.
    if unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

fn two_mounts() -> (TestCluster, Mount, Mount) {
    let c = TestCluster::start(2, "32M");
    let a = Mount::new(&c, "attr_timeout=0,allow_other");
    let b = Mount::new(&c, "attr_timeout=0,transport=tcp,allow_other");
    (c, a, b)
}

#[test]
fn attributes_follow_linux_names_flags_and_limits() {
    let (_c, m, _b) = two_mounts();
    let f = m.path("f");
    fs::write(&f, b"data").unwrap();
    assert_eq!(get(&f, "user.none"), Err(libc::ENODATA));
    assert_eq!(list(&f), Ok(vec![]));
    set(&f, "user.color", b"blue", 0).unwrap();
    assert_eq!(get(&f, "user.color").unwrap(), b"blue");
    // Asking with size 0 gives the length; a buffer too small is ERANGE.
    assert_eq!(get_into(&f, "user.color", 0).unwrap().len(), 4);
    assert_eq!(get_into(&f, "user.color", 3), Err(libc::ERANGE));
    // XATTR_CREATE on an existing name, XATTR_REPLACE on a missing one.
    assert_eq!(
        set(&f, "user.color", b"red", libc::XATTR_CREATE),
        Err(libc::EEXIST)
    );
    assert_eq!(
        set(&f, "user.shape", b"x", libc::XATTR_REPLACE),
        Err(libc::ENODATA)
    );
    set(&f, "user.color", b"red", libc::XATTR_REPLACE).unwrap();
    assert_eq!(get(&f, "user.color").unwrap(), b"red");
    // An empty value is a value.
    set(&f, "user.empty", b"", 0).unwrap();
    assert_eq!(get(&f, "user.empty").unwrap(), b"");
    set(&f, "security.label", b"s0", 0).unwrap();
    assert_eq!(
        list(&f).unwrap(),
        ["security.label", "user.color", "user.empty"]
    );
    // Unknown namespaces and POSIX ACLs are not supported.
    assert_eq!(set(&f, "os2.name", b"x", 0), Err(libc::EOPNOTSUPP));
    assert_eq!(get(&f, "os2.name"), Err(libc::EOPNOTSUPP));
    // Linux's limits: a name over 255 bytes, a value over 64 KiB.
    let long = format!("user.{}", "n".repeat(251));
    assert_eq!(set(&f, &long, b"x", 0), Err(libc::ERANGE));
    assert_eq!(set(&f, "user.big", &vec![1; 65537], 0), Err(libc::E2BIG));
    let max = vec![9u8; 65536];
    set(&f, "user.max", &max, 0).unwrap();
    assert_eq!(get(&f, "user.max").unwrap(), max);
    // An inode holds at most 256 KiB of names and values: the fourth 64 KiB value is ENOSPC,
    // and nothing set before is lost.
    set(&f, "user.max2", &max, 0).unwrap();
    set(&f, "user.max3", &max, 0).unwrap();
    assert_eq!(set(&f, "user.max4", &max, 0), Err(libc::ENOSPC));
    assert_eq!(get(&f, "user.max3").unwrap(), max);
    remove(&f, "user.max3").unwrap();
    set(&f, "user.max4", &max, 0).unwrap();
    // Remove; removing again is ENODATA.
    remove(&f, "user.color").unwrap();
    assert_eq!(remove(&f, "user.color"), Err(libc::ENODATA));
    assert_eq!(get(&f, "user.color"), Err(libc::ENODATA));
    // Directories carry them too; user. attributes on a symlink are refused by Linux.
    fs::create_dir(m.path("d")).unwrap();
    set(&m.path("d"), "user.dir", b"1", 0).unwrap();
    assert_eq!(get(&m.path("d"), "user.dir").unwrap(), b"1");
    // A missing file is ENOENT.
    assert_eq!(get(&m.path("nope"), "user.a"), Err(libc::ENOENT));
    // Setting an attribute moves the ctime.
    let before = fs::metadata(&f).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    set(&f, "user.t", b"1", 0).unwrap();
    let after = fs::metadata(&f).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(
        (after.ctime(), after.ctime_nsec()) > (before.ctime(), before.ctime_nsec()),
        "setxattr moves the ctime"
    );
}

#[test]
fn attributes_are_coherent_across_mounts_and_go_with_their_inode() {
    let (_c, a, b) = two_mounts();
    fs::write(a.path("f"), b"x").unwrap();
    set(&a.path("f"), "user.k", b"from a", 0).unwrap();
    // The other mount sees it at once, changes it, and the first sees the change.
    assert_eq!(get(&b.path("f"), "user.k").unwrap(), b"from a");
    set(&b.path("f"), "user.k", b"from b", 0).unwrap();
    assert_eq!(get(&a.path("f"), "user.k").unwrap(), b"from b");
    remove(&b.path("f"), "user.k").unwrap();
    assert_eq!(get(&a.path("f"), "user.k"), Err(libc::ENODATA));
    // They belong to the inode: a hard link and a rename keep them.
    set(&a.path("f"), "user.k", b"v", 0).unwrap();
    fs::hard_link(a.path("f"), a.path("g")).unwrap();
    fs::rename(a.path("f"), a.path("h")).unwrap();
    assert_eq!(get(&b.path("g"), "user.k").unwrap(), b"v");
    assert_eq!(get(&b.path("h"), "user.k").unwrap(), b"v");
    // Deleted with the last name; a new file of the same name starts with none.
    fs::remove_file(a.path("g")).unwrap();
    fs::remove_file(a.path("h")).unwrap();
    fs::write(b.path("h"), b"new").unwrap();
    assert_eq!(list(&a.path("h")), Ok(vec![]));
}

/// Every attribute of every file under `dir`, by relative path.
fn all_attrs(dir: &Path) -> Vec<(String, String, Vec<u8>)> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let rel = p.file_name().unwrap().to_string_lossy().into_owned();
        for name in list(&p).unwrap() {
            let v = get(&p, &name).unwrap();
            out.push((rel.clone(), name, v));
        }
    }
    out.sort();
    out
}

#[test]
fn cp_a_and_rsync_x_keep_attributes() {
    let (_c, a, b) = two_mounts();
    let src = TempDir::in_memory("xattr-src");
    for i in 0..5 {
        let p = src.path().join(format!("f{i}"));
        fs::write(&p, vec![i as u8; 1000 * i]).unwrap();
        set(&p, "user.index", i.to_string().as_bytes(), 0).unwrap();
        set(&p, "user.blob", &vec![i as u8; 3000], 0).unwrap();
    }
    let want = all_attrs(src.path());
    assert_eq!(want.len(), 10);

    // tmpfs -> RackFS with cp -a; RackFS -> RackFS (other mount) with cp -a.
    let run = |cmd: &mut Command| {
        let out = cmd.output().expect("run");
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(Command::new("cp")
        .arg("-a")
        .arg(src.path())
        .arg(a.path("cp1")));
    assert_eq!(all_attrs(&a.path("cp1")), want);
    run(Command::new("cp")
        .arg("-a")
        .arg(a.path("cp1"))
        .arg(b.path("cp2")));
    assert_eq!(all_attrs(&b.path("cp2")), want);

    // rsync -aX from tmpfs and back out to tmpfs.
    run(Command::new("rsync")
        .arg("-aX")
        .arg(format!("{}/", src.path().display()))
        .arg(a.path("rs1")));
    assert_eq!(all_attrs(&a.path("rs1")), want);
    let back = TempDir::in_memory("xattr-back");
    run(Command::new("rsync")
        .arg("-aX")
        .arg(format!("{}/", b.path("rs1").display()))
        .arg(back.path()));
    assert_eq!(all_attrs(back.path()), want);
}

/// `rackfs.replicas` reads a file's replica count and sets it before the first write (a
/// virtual attribute, not listed): the file's stripes then get that many copies.
#[test]
fn rackfs_replicas_sets_a_files_replica_count_before_its_first_write() {
    use std::os::unix::fs::MetadataExt;
    let c = TestCluster::start(3, "32M");
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    let (three, one) = (m.path("three"), m.path("one"));
    fs::write(&three, b"").unwrap();
    fs::write(&one, b"").unwrap();
    assert_eq!(
        get(&three, "rackfs.replicas").unwrap(),
        b"2",
        "the cluster's default"
    );
    set(&three, "rackfs.replicas", b"3", 0).unwrap();
    set(&one, "rackfs.replicas", b"1", 0).unwrap();
    assert_eq!(list(&three), Ok(vec![]), "virtual: not listed");
    for bad in [&b"0"[..], b"9", b"two"] {
        assert_eq!(set(&three, "rackfs.replicas", bad, 0), Err(libc::EINVAL));
    }
    let data = vec![5u8; 1 << 20];
    fs::write(&three, &data).unwrap();
    fs::write(&one, &data).unwrap();
    let bytes = |p: &Path| fs::metadata(p).unwrap().blocks() * 512;
    assert_eq!(bytes(&three), 3 << 20, "three copies of 1 MiB");
    assert_eq!(bytes(&one), 1 << 20, "one copy of 1 MiB");
    assert_eq!(get(&three, "rackfs.replicas").unwrap(), b"3");
    // Once written, the count stays.
    assert_eq!(set(&three, "rackfs.replicas", b"2", 0), Err(libc::EINVAL));
    assert_eq!(fs::read(&three).unwrap(), data);
}
