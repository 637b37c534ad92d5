//! Extended attributes of one inode, with Linux's limits and errors.
//!
//! Names carry their namespace prefix. `user.`, `trusted.` and `security.` are kept (the
//! kernel checks who may touch which before asking); any other namespace, `system.` (POSIX
//! ACLs) included, is refused with `EOPNOTSUPP`. The attributes live in the namespace, so they
//! are journaled to the standby with every change, answered only by the primary (every mount
//! sees the last value set), and go away with their inode.

use std::collections::BTreeMap;

use rackfs_proto::namespace::{
    XATTR_CREATE, XATTR_LIST_MAX, XATTR_NAME_MAX, XATTR_REPLACE, XATTR_SIZE_MAX, XATTR_TOTAL_MAX,
};
use rackfs_proto::{ErrorCode, Refusal};
use serde::{Deserialize, Serialize};

const NAMESPACES: [&[u8]; 3] = [b"user.", b"trusted.", b"security."];

/// An inode's extended attributes: name to value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xattrs(BTreeMap<Vec<u8>, Vec<u8>>);

fn refuse<T>(code: ErrorCode, msg: String) -> Result<T, Refusal> {
    Err(Refusal::new(code, msg))
}

fn check_name(name: &[u8]) -> Result<(), Refusal> {
    let shown = String::from_utf8_lossy(name);
    if name.is_empty() || name.len() > XATTR_NAME_MAX {
        return refuse(
            ErrorCode::Range,
            format!(
                "extended attribute names are 1 to {XATTR_NAME_MAX} bytes, not {}",
                name.len()
            ),
        );
    }
    if name.contains(&0) {
        return refuse(
            ErrorCode::Invalid,
            format!("attribute name {shown:?} holds a NUL"),
        );
    }
    match NAMESPACES.iter().find(|p| name.starts_with(p)) {
        Some(p) if name.len() == p.len() => refuse(
            ErrorCode::Invalid,
            format!("attribute name {shown:?} has a namespace but no name"),
        ),
        Some(_) => Ok(()),
        None => refuse(
            ErrorCode::NotSupported,
            format!("attribute namespace of {shown:?} is not supported (user., trusted. and security. are)"),
        ),
    }
}

impl Xattrs {
    /// Sets `name` to `value` under `flags` (`XATTR_CREATE`, `XATTR_REPLACE`).
    pub fn set(&mut self, name: &[u8], value: &[u8], flags: u32) -> Result<(), Refusal> {
        check_name(name)?;
        let shown = String::from_utf8_lossy(name);
        if flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 || flags == XATTR_CREATE | XATTR_REPLACE {
            return refuse(ErrorCode::Invalid, format!("setxattr flags {flags:#x}"));
        }
        if value.len() > XATTR_SIZE_MAX {
            return refuse(
                ErrorCode::ValueTooBig,
                format!(
                    "attribute values are at most {XATTR_SIZE_MAX} bytes, not {}",
                    value.len()
                ),
            );
        }
        let old = self.0.get(name);
        match (old, flags) {
            (Some(_), XATTR_CREATE) => {
                return refuse(ErrorCode::Exists, format!("attribute {shown} exists"))
            }
            (None, XATTR_REPLACE) => {
                return refuse(ErrorCode::NoData, format!("no attribute {shown}"))
            }
            _ => {}
        }
        let (names, total) = self.sizes();
        let (old_names, old_total) = old.map_or((0, 0), |v| (name.len() + 1, name.len() + v.len()));
        let names = names - old_names + name.len() + 1;
        let total = total - old_total + name.len() + value.len();
        if names > XATTR_LIST_MAX || total > XATTR_TOTAL_MAX {
            return refuse(
                ErrorCode::OutOfMemory,
                format!(
                    "an inode's attributes hold at most {XATTR_LIST_MAX} bytes of names and \
                     {XATTR_TOTAL_MAX} bytes in all; setting {shown} would make {names} and {total}"
                ),
            );
        }
        self.0.insert(name.to_vec(), value.to_vec());
        Ok(())
    }

    pub fn get(&self, name: &[u8]) -> Result<&[u8], Refusal> {
        check_name(name)?;
        match self.0.get(name) {
            Some(v) => Ok(v),
            None => refuse(
                ErrorCode::NoData,
                format!("no attribute {}", String::from_utf8_lossy(name)),
            ),
        }
    }

    /// The names, each followed by a NUL.
    pub fn list(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for name in self.0.keys() {
            out.extend_from_slice(name);
            out.push(0);
        }
        out
    }

    pub fn remove(&mut self, name: &[u8]) -> Result<(), Refusal> {
        check_name(name)?;
        match self.0.remove(name) {
            Some(_) => Ok(()),
            None => refuse(
                ErrorCode::NoData,
                format!("no attribute {}", String::from_utf8_lossy(name)),
            ),
        }
    }

    /// Bytes of the name list, and of names and values together.
    fn sizes(&self) -> (usize, usize) {
        self.0.iter().fold((0, 0), |(n, t), (k, v)| {
            (n + k.len() + 1, t + k.len() + v.len())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: Result<impl Sized, Refusal>) -> ErrorCode {
        match r {
            Ok(_) => panic!("expected a refusal"),
            Err(e) => e.code,
        }
    }

    #[test]
    fn names_and_flags_follow_linux() {
        let mut x = Xattrs::default();
        assert_eq!(code(x.get(b"user.a")), ErrorCode::NoData);
        assert_eq!(
            code(x.set(b"user.a", b"1", XATTR_REPLACE)),
            ErrorCode::NoData
        );
        x.set(b"user.a", b"1", XATTR_CREATE).unwrap();
        assert_eq!(
            code(x.set(b"user.a", b"2", XATTR_CREATE)),
            ErrorCode::Exists
        );
        x.set(b"user.a", b"2", XATTR_REPLACE).unwrap();
        assert_eq!(x.get(b"user.a").unwrap(), b"2");
        assert_eq!(
            code(x.set(b"system.posix_acl_access", b"", 0)),
            ErrorCode::NotSupported
        );
        assert_eq!(code(x.set(b"os2.a", b"", 0)), ErrorCode::NotSupported);
        assert_eq!(code(x.set(b"user.", b"", 0)), ErrorCode::Invalid);
        assert_eq!(code(x.set(&[b'u'; 256], b"", 0)), ErrorCode::Range);
        assert_eq!(code(x.set(b"", b"", 0)), ErrorCode::Range);
        assert_eq!(
            code(x.set(b"user.big", &vec![0; XATTR_SIZE_MAX + 1], 0)),
            ErrorCode::ValueTooBig
        );
        assert_eq!(code(x.set(b"user.b", b"", 3)), ErrorCode::Invalid);
        x.set(b"security.b", b"", 0).unwrap();
        assert_eq!(x.list(), b"security.b\0user.a\0");
        x.remove(b"user.a").unwrap();
        assert_eq!(code(x.remove(b"user.a")), ErrorCode::NoData);
        assert_eq!(x.list(), b"security.b\0");
    }

    #[test]
    fn an_inode_holds_a_bounded_total() {
        let mut x = Xattrs::default();
        let v = vec![7; XATTR_SIZE_MAX];
        let mut set = 0;
        while x.set(format!("user.{set}").as_bytes(), &v, 0).is_ok() {
            set += 1;
        }
        // Three 64 KiB values fit in 256 KiB with their names; a fourth does not.
        assert_eq!(set, 3);
        assert_eq!(code(x.set(b"user.more", &v, 0)), ErrorCode::OutOfMemory);
        // Replacing a value by one of the same size still fits.
        x.set(b"user.0", &v, XATTR_REPLACE).unwrap();
    }
}
