//! A minimal writer for the "newc" cpio format, the one the kernel unpacks as an initramfs.
//!
//! Only what an initramfs needs: directories, regular files, symlinks and character devices
//! (the kernel opens `/dev/console` before it runs `/init`, and devtmpfs is not mounted yet).
//! Every entry belongs to root and has mtime 0, so the same inputs give the same bytes.

use std::io::{self, Write};

const MAGIC: &[u8; 6] = b"070701";
const TRAILER: &str = "TRAILER!!!";

pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFCHR: u32 = 0o020000;

pub struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        // Inode 0 is avoided: some readers treat it as "no inode".
        Self { out, next_ino: 1, written: 0 }
    }

    /// A directory; parents must come first (the kernel does not create them).
    pub fn dir(&mut self, path: &str, perm: u32) -> io::Result<()> {
        self.entry(path, S_IFDIR | (perm & 0o7777), 2, (0, 0), &[])
    }

    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, S_IFREG | (perm & 0o7777), 1, (0, 0), data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.entry(path, S_IFLNK | 0o777, 1, (0, 0), target.as_bytes())
    }

    pub fn char_dev(&mut self, path: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(path, S_IFCHR | (perm & 0o7777), 1, (major, minor), &[])
    }

    /// Writes the trailer and pads the archive to a 512-byte block, as cpio(1) does.
    pub fn finish(mut self) -> io::Result<W> {
        self.header(TRAILER, 0, 0, 1, (0, 0), 0)?;
        self.pad_to(512)?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn entry(&mut self, path: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) -> io::Result<()> {
        // Archive names are relative ("bin/sh"); the kernel unpacks them under "/".
        let name = path.trim_start_matches('/');
        if name.is_empty() || name == TRAILER || name.contains('\0') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad cpio entry name {path:?}")));
        }
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{path} is over 4 GiB")))?;
        let ino = self.next_ino;
        self.next_ino += 1;
        self.header(name, ino, mode, nlink, rdev, size)?;
        self.write(data)?;
        self.pad_to(4)
    }

    fn header(
        &mut self,
        name: &str,
        ino: u32,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        size: u32,
    ) -> io::Result<()> {
        let namesize = name.len() as u32 + 1;
        // ino mode uid gid nlink mtime filesize devmajor devminor rdevmajor rdevminor namesize check
        let fields = [ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, namesize, 0];
        let mut header = Vec::with_capacity(110 + name.len() + 1);
        header.extend_from_slice(MAGIC);
        for f in fields {
            header.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        header.extend_from_slice(name.as_bytes());
        header.push(0);
        self.write(&header)?;
        self.pad_to(4)
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> io::Result<()> {
        let pad = (align - self.written % align) % align;
        self.write(&vec![0; pad as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Entry {
        name: String,
        ino: u32,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: Vec<u8>,
    }

    /// An independent reader: parses what the writer wrote, checking alignment on the way.
    fn parse(mut buf: &[u8]) -> Vec<Entry> {
        let total = buf.len();
        let mut entries = Vec::new();
        let align = |buf: &mut &[u8], total: usize| {
            let off = total - buf.len();
            *buf = &buf[(4 - off % 4) % 4..];
        };
        loop {
            assert_eq!(&buf[..6], MAGIC);
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&buf[6 + 8 * i..14 + 8 * i]).unwrap(), 16).unwrap()
            };
            let (ino, mode, nlink, size) = (field(0), field(1), field(4), field(6) as usize);
            let (rdev, namesize) = ((field(9), field(10)), field(11) as usize);
            assert_eq!((field(2), field(3), field(5), field(12)), (0, 0, 0, 0), "uid gid mtime check");
            let name = std::str::from_utf8(&buf[110..110 + namesize - 1]).unwrap().to_string();
            assert_eq!(buf[110 + namesize - 1], 0, "name is NUL-terminated");
            buf = &buf[110 + namesize..];
            align(&mut buf, total);
            if name == TRAILER {
                assert_eq!(total % 512, 0, "archive is padded to 512 bytes");
                assert!(buf.iter().all(|&b| b == 0));
                return entries;
            }
            let data = buf[..size].to_vec();
            buf = &buf[size..];
            align(&mut buf, total);
            entries.push(Entry { name, ino, mode, nlink, rdev, data });
        }
    }

    fn sample() -> Vec<u8> {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("/bin", 0o755).unwrap();
        w.file("/bin/busybox", 0o755, b"odd-sized data").unwrap();
        w.symlink("/bin/sh", "busybox").unwrap();
        w.dir("dev", 0o755).unwrap();
        w.char_dev("/dev/console", 0o600, 5, 1).unwrap();
        w.file("/empty", 0o644, b"").unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn round_trip() {
        let entries = parse(&sample());
        let e = |name: &str, ino, mode, nlink, rdev, data: &[u8]| Entry {
            name: name.to_string(),
            ino,
            mode,
            nlink,
            rdev,
            data: data.to_vec(),
        };
        assert_eq!(
            entries,
            vec![
                e("bin", 1, 0o040755, 2, (0, 0), b""),
                e("bin/busybox", 2, 0o100755, 1, (0, 0), b"odd-sized data"),
                e("bin/sh", 3, 0o120777, 1, (0, 0), b"busybox"),
                e("dev", 4, 0o040755, 2, (0, 0), b""),
                e("dev/console", 5, 0o020600, 1, (5, 1), b""),
                e("empty", 6, 0o100644, 1, (0, 0), b""),
            ]
        );
    }

    #[test]
    fn rejects_bad_names() {
        let mut w = CpioWriter::new(Vec::new());
        assert!(w.file("/", 0o644, b"").is_err());
        assert!(w.file("TRAILER!!!", 0o644, b"").is_err());
        assert!(w.file("a\0b", 0o644, b"").is_err());
    }

    /// Cross-check with GNU cpio (installed by `cargo xtask test`).
    #[test]
    fn gnu_cpio_lists_it() {
        use std::process::{Command, Stdio};
        let mut child = Command::new("cpio")
            .args(["-t", "-v", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("GNU cpio checks our archives: apt-get install cpio (cargo xtask test installs it)");
        child.stdin.take().unwrap().write_all(&sample()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "cpio -t: {}", String::from_utf8_lossy(&out.stderr));
        let listing = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = listing.lines().collect();
        assert_eq!(lines.len(), 6, "{listing}");
        assert!(lines[0].starts_with("drwxr-xr-x") && lines[0].ends_with(" bin"), "{listing}");
        assert!(lines[1].starts_with("-rwxr-xr-x") && lines[1].contains(" 14 "), "{listing}");
        assert!(lines[2].starts_with("lrwxrwxrwx") && lines[2].ends_with("bin/sh -> busybox"), "{listing}");
        assert!(lines[4].starts_with("crw-------") && lines[4].contains("5,"), "{listing}");
    }
}
