//! A small reader for the kernel's BTF (`/sys/kernel/btf/vmlinux`): just what start-up needs to
//! find struct member offsets, tracepoint argument positions and enumerator values.
//!
//! aya-obj parses BTF too, but keeps type lookup by id private; this covers the read-only part.

use std::collections::HashMap;

use thiserror::Error;

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

#[derive(Debug, Error)]
pub enum BtfError {
    #[error("BTF data is malformed: {0}")]
    Malformed(&'static str),
    #[error("BTF has no struct `{0}`")]
    NoStruct(String),
    #[error("struct `{strukt}` has no member `{member}` in this kernel's BTF")]
    NoMember { strukt: String, member: String },
}

/// BTF kinds (`BTF_KIND_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Int,
    Ptr,
    Array,
    Struct,
    Union,
    Enum,
    Fwd,
    Typedef,
    Volatile,
    Const,
    Restrict,
    Func,
    FuncProto,
    Var,
    DataSec,
    Float,
    DeclTag,
    TypeTag,
    Enum64,
}

impl Kind {
    fn from_raw(raw: u32) -> Option<Kind> {
        use Kind::*;
        Some(match raw {
            1 => Int,
            2 => Ptr,
            3 => Array,
            4 => Struct,
            5 => Union,
            6 => Enum,
            7 => Fwd,
            8 => Typedef,
            9 => Volatile,
            10 => Const,
            11 => Restrict,
            12 => Func,
            13 => FuncProto,
            14 => Var,
            15 => DataSec,
            16 => Float,
            17 => DeclTag,
            18 => TypeTag,
            19 => Enum64,
            _ => return None,
        })
    }
}

/// One parsed type: its header and where its trailing records start.
#[derive(Clone, Copy, Debug)]
struct Type {
    name_off: u32,
    kind: Kind,
    vlen: u32,
    kind_flag: bool,
    /// `size` or `type` of the header, depending on kind.
    size_or_type: u32,
    /// Byte offset of the trailing records in the type section.
    extra: usize,
}

/// A struct or union member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub type_id: u32,
    pub bit_offset: u32,
}

pub struct Btf {
    types: Vec<Type>,
    type_data: Vec<u8>,
    strings: Vec<u8>,
    by_name: HashMap<String, Vec<u32>>,
    /// Every lookup start-up made, in order: what a fixture of this kernel keeps.
    #[cfg(test)]
    reads: std::sync::Mutex<Vec<fixtures::Read>>,
}

fn u32_at(data: &[u8], off: usize) -> Result<u32, BtfError> {
    data.get(off..off + 4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .ok_or(BtfError::Malformed("truncated"))
}

/// The type and string sections of a BTF blob.
fn sections(data: &[u8]) -> Result<(&[u8], &[u8]), BtfError> {
    if data.len() < 24 || data[0..2] != [0x9f, 0xeb] {
        return Err(BtfError::Malformed("bad magic (not little-endian BTF)"));
    }
    let hdr_len = u32_at(data, 4)? as usize;
    let (type_off, type_len) = (u32_at(data, 8)? as usize, u32_at(data, 12)? as usize);
    let (str_off, str_len) = (u32_at(data, 16)? as usize, u32_at(data, 20)? as usize);
    let section = |off: usize, len: usize| {
        data.get(hdr_len + off..hdr_len + off + len).ok_or(BtfError::Malformed("section out of bounds"))
    };
    Ok((section(type_off, type_len)?, section(str_off, str_len)?))
}

impl Btf {
    pub fn from_sys_fs() -> std::io::Result<Btf> {
        let data = std::fs::read(VMLINUX)?;
        Btf::parse(&data).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Parses little-endian BTF (the only byte order tracerd runs on).
    pub fn parse(data: &[u8]) -> Result<Btf, BtfError> {
        let (type_data, strings) = sections(data)?;
        let mut btf = Btf {
            types: vec![],
            type_data: type_data.to_vec(),
            strings: strings.to_vec(),
            by_name: HashMap::new(),
            #[cfg(test)]
            reads: Default::default(),
        };
        btf.index_types(0)?;
        Ok(btf)
    }

    /// Parses a module's split BTF (`/sys/kernel/btf/<module>`), whose type ids and string
    /// offsets continue those of `base` (vmlinux's): the result holds both.
    pub fn parse_split(data: &[u8], base: &Btf) -> Result<Btf, BtfError> {
        let (type_data, strings) = sections(data)?;
        let mut btf = Btf {
            types: base.types.clone(),
            type_data: base.type_data.clone(),
            strings: base.strings.clone(),
            by_name: HashMap::new(),
            #[cfg(test)]
            reads: Default::default(),
        };
        let from = btf.type_data.len();
        btf.type_data.extend_from_slice(type_data);
        btf.strings.extend_from_slice(strings);
        btf.index_types(from)?;
        Ok(btf)
    }

    /// Indexes the types from byte `from` of the type section on (0: all, after `void`).
    fn index_types(&mut self, from: usize) -> Result<(), BtfError> {
        if self.types.is_empty() {
            // Type id 0 is `void`; ids count from 1.
            self.types.push(Type {
                name_off: 0,
                kind: Kind::Int,
                vlen: 0,
                kind_flag: false,
                size_or_type: 0,
                extra: 0,
            });
        }
        let data = &self.type_data;
        let mut off = from;
        while off < data.len() {
            let name_off = u32_at(data, off)?;
            let info = u32_at(data, off + 4)?;
            let size_or_type = u32_at(data, off + 8)?;
            let kind = Kind::from_raw((info >> 24) & 0x1f).ok_or(BtfError::Malformed("unknown kind"))?;
            let vlen = info & 0xffff;
            let extra = off + 12;
            let extra_len = match kind {
                Kind::Int | Kind::Var | Kind::DeclTag => 4,
                Kind::Array => 12,
                Kind::Struct | Kind::Union | Kind::DataSec | Kind::Enum64 => 12 * vlen as usize,
                Kind::Enum | Kind::FuncProto => 8 * vlen as usize,
                _ => 0,
            };
            self.types.push(Type { name_off, kind, vlen, kind_flag: info >> 31 == 1, size_or_type, extra });
            off = extra + extra_len;
        }
        self.by_name.clear();
        for id in 1..self.types.len() as u32 {
            let name = self.name_of(id);
            if !name.is_empty() {
                let name = name.to_owned();
                self.by_name.entry(name).or_default().push(id);
            }
        }
        Ok(())
    }

    fn string(&self, off: u32) -> &str {
        let bytes = self.strings.get(off as usize..).unwrap_or_default();
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        std::str::from_utf8(&bytes[..end]).unwrap_or("")
    }

    fn name_of(&self, id: u32) -> &str {
        self.types.get(id as usize).map_or("", |t| self.string(t.name_off))
    }

    fn ty(&self, id: u32) -> Option<&Type> {
        self.types.get(id as usize).filter(|_| id != 0)
    }

    fn word(&self, off: usize) -> u32 {
        u32_at(&self.type_data, off).unwrap_or(0)
    }

    /// The first type with this name and kind.
    pub fn find(&self, name: &str, kind: Kind) -> Option<u32> {
        self.by_name.get(name)?.iter().copied().find(|&id| self.types[id as usize].kind == kind)
    }

    /// Follows typedefs and qualifiers (const, volatile, restrict, type tags).
    pub fn skip_modifiers(&self, mut id: u32) -> u32 {
        while let Some(t) = self.ty(id) {
            match t.kind {
                Kind::Typedef | Kind::Volatile | Kind::Const | Kind::Restrict | Kind::TypeTag => {
                    id = t.size_or_type
                }
                _ => break,
            }
        }
        id
    }

    /// Members of a struct or union.
    pub fn members(&self, id: u32) -> Vec<Member> {
        let Some(t) = self.ty(id).filter(|t| matches!(t.kind, Kind::Struct | Kind::Union)) else {
            return vec![];
        };
        (0..t.vlen as usize)
            .map(|i| {
                let rec = t.extra + 12 * i;
                let raw_offset = self.word(rec + 8);
                Member {
                    name: self.string(self.word(rec)).to_owned(),
                    type_id: self.word(rec + 4),
                    // With kind_flag set, the top 8 bits hold a bitfield size.
                    bit_offset: if t.kind_flag { raw_offset & 0xff_ffff } else { raw_offset },
                }
            })
            .collect()
    }

    /// Finds `name` among a struct's members, looking through anonymous structs and unions.
    /// Returns the member's bit offset from the start of the struct.
    fn find_member(&self, id: u32, name: &str) -> Option<Member> {
        for m in self.members(self.skip_modifiers(id)) {
            if m.name == name {
                return Some(m);
            }
            if m.name.is_empty()
                && let Some(inner) = self.find_member(m.type_id, name)
            {
                return Some(Member { bit_offset: m.bit_offset + inner.bit_offset, ..inner });
            }
        }
        None
    }

    /// Byte offset of a member path such as `["bi_iter", "bi_sector"]` in `struct NAME`.
    pub fn member_offset(&self, strukt: &str, path: &[&str]) -> Result<u32, BtfError> {
        #[cfg(test)]
        self.note(fixtures::Read::Member(strukt.into(), path.join(".")));
        let mut id = self.find(strukt, Kind::Struct).ok_or_else(|| BtfError::NoStruct(strukt.into()))?;
        let mut bits = 0;
        for member in path {
            let m = self
                .find_member(id, member)
                .ok_or_else(|| BtfError::NoMember { strukt: strukt.into(), member: path.join(".") })?;
            bits += m.bit_offset;
            id = m.type_id;
        }
        Ok(bits / 8)
    }

    /// `sizeof(struct NAME)`.
    pub fn struct_size(&self, strukt: &str) -> Result<u32, BtfError> {
        let id = self.find(strukt, Kind::Struct).ok_or_else(|| BtfError::NoStruct(strukt.into()))?;
        Ok(self.types[id as usize].size_or_type)
    }

    pub fn has_member(&self, strukt: &str, member: &str) -> bool {
        #[cfg(test)]
        self.note(fixtures::Read::Member(strukt.into(), member.into()));
        self.find(strukt, Kind::Struct).is_some_and(|id| self.find_member(id, member).is_some())
    }

    /// Parameters of the function prototype behind a `btf_trace_<tracepoint>` typedef, without
    /// the leading `void *__data`: for each, the struct its pointer points to (or "" if none).
    pub fn tracepoint_args(&self, tracepoint: &str) -> Option<Vec<String>> {
        #[cfg(test)]
        self.note(fixtures::Read::Tracepoint(tracepoint.into()));
        let typedef = self.find(&format!("btf_trace_{tracepoint}"), Kind::Typedef)?;
        let ptr = self.skip_modifiers(typedef);
        let proto = self.skip_modifiers(self.ty(ptr).filter(|t| t.kind == Kind::Ptr)?.size_or_type);
        let proto_t = self.ty(proto).filter(|t| t.kind == Kind::FuncProto)?;
        let params = (0..proto_t.vlen as usize).map(|i| self.word(proto_t.extra + 8 * i + 4));
        Some(params.skip(1).map(|p| self.pointee_struct(p).unwrap_or_default()).collect())
    }

    fn pointee_struct(&self, id: u32) -> Option<String> {
        let t = self.ty(self.skip_modifiers(id)).filter(|t| t.kind == Kind::Ptr)?;
        let target = self.skip_modifiers(t.size_or_type);
        let tt = self.ty(target).filter(|t| matches!(t.kind, Kind::Struct | Kind::Fwd))?;
        let _ = tt;
        Some(self.name_of(target).to_owned())
    }

    /// Value of an enumerator (`REQ_OP_WRITE`, `__REQ_SYNC`) in any enum.
    pub fn enumerator(&self, name: &str) -> Option<i64> {
        #[cfg(test)]
        self.note(fixtures::Read::Enumerator(name.into()));
        self.types.iter().find_map(|t| match t.kind {
            Kind::Enum => (0..t.vlen as usize)
                .map(|i| t.extra + 8 * i)
                .find(|&rec| self.string(self.word(rec)) == name)
                .map(|rec| self.word(rec + 4) as i32 as i64),
            Kind::Enum64 => (0..t.vlen as usize)
                .map(|i| t.extra + 12 * i)
                .find(|&rec| self.string(self.word(rec)) == name)
                .map(|rec| ((self.word(rec + 8) as u64) << 32 | self.word(rec + 4) as u64) as i64),
            _ => None,
        })
    }

    #[cfg(test)]
    fn note(&self, read: fixtures::Read) {
        self.reads.lock().unwrap().push(read);
    }
}

#[cfg(test)]
#[path = "fixtures/mod.rs"]
pub(crate) mod fixtures;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds a tiny BTF blob by hand, so the parser is tested without a kernel.
    #[derive(Default)]
    pub struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
        next_id: u32,
        /// For split BTF: the base's string section length, where this one's offsets start.
        str_base: u32,
    }

    impl Builder {
        pub fn new() -> Self {
            Builder { types: vec![], strings: vec![0], next_id: 1, str_base: 0 }
        }
        /// A module's BTF on top of `base`: type ids and string offsets continue the base's.
        pub fn split(base: &Builder) -> Self {
            Builder {
                types: vec![],
                strings: vec![],
                next_id: base.next_id,
                str_base: base.str_base + base.strings.len() as u32,
            }
        }
        fn str(&mut self, s: &str) -> u32 {
            if s.is_empty() {
                return 0;
            }
            let off = self.str_base + self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }
        fn header(&mut self, name: &str, kind: u32, vlen: u32, size_or_type: u32) -> u32 {
            let name = self.str(name);
            for w in [name, kind << 24 | vlen, size_or_type] {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            self.next_id += 1;
            self.next_id - 1
        }
        pub fn int(&mut self, name: &str, size: u32) -> u32 {
            let id = self.header(name, 1, 0, size);
            self.types.extend_from_slice(&(size * 8).to_le_bytes());
            id
        }
        pub fn ptr(&mut self, to: u32) -> u32 {
            self.header("", 2, 0, to)
        }
        pub fn typedef(&mut self, name: &str, to: u32) -> u32 {
            self.header(name, 8, 0, to)
        }
        pub fn fwd(&mut self, name: &str) -> u32 {
            self.header(name, 7, 0, 0)
        }
        /// `members`: (name, type id, byte offset).
        pub fn strukt(&mut self, name: &str, kind: u32, size: u32, members: &[(&str, u32, u32)]) -> u32 {
            let recs: Vec<[u32; 3]> = members.iter().map(|&(n, t, o)| [self.str(n), t, o * 8]).collect();
            let id = self.header(name, kind, members.len() as u32, size);
            for r in recs.iter().flatten() {
                self.types.extend_from_slice(&r.to_le_bytes());
            }
            id
        }
        pub fn func_proto(&mut self, params: &[u32]) -> u32 {
            let id = self.header("", 13, params.len() as u32, 0);
            for &p in params {
                self.types.extend_from_slice(&[0u8; 4]);
                self.types.extend_from_slice(&p.to_le_bytes());
            }
            id
        }
        pub fn enumeration(&mut self, name: &str, values: &[(&str, i32)]) -> u32 {
            let recs: Vec<(u32, i32)> = values.iter().map(|&(n, v)| (self.str(n), v)).collect();
            let id = self.header(name, 6, values.len() as u32, 4);
            for (n, v) in recs {
                self.types.extend_from_slice(&n.to_le_bytes());
                self.types.extend_from_slice(&v.to_le_bytes());
            }
            id
        }
        /// A `btf_trace_<tp>` typedef taking `void *` then `params`.
        pub fn tracepoint(&mut self, tp: &str, params: &[u32]) {
            let void_ptr = self.ptr(0);
            let mut all = vec![void_ptr];
            all.extend_from_slice(params);
            let proto = self.func_proto(&all);
            let ptr = self.ptr(proto);
            self.typedef(&format!("btf_trace_{tp}"), ptr);
        }
        pub fn build(&self) -> Vec<u8> {
            let mut out = vec![0x9f, 0xeb, 1, 0];
            let hdr = [24u32, 0, self.types.len() as u32, self.types.len() as u32, self.strings.len() as u32];
            for w in hdr {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.extend_from_slice(&self.types);
            out.extend_from_slice(&self.strings);
            out
        }
    }

    #[test]
    fn member_offsets_through_anonymous_unions_and_nested_structs() {
        let mut b = Builder::new();
        let u32t = b.int("unsigned int", 4);
        let u64t = b.int("long long unsigned int", 8);
        let iter = b.strukt("bvec_iter", 4, 16, &[("bi_sector", u64t, 0), ("bi_size", u32t, 8)]);
        let anon = b.strukt("", 5, 8, &[("bi_opf", u32t, 0), ("other", u64t, 0)]);
        b.strukt("bio", 4, 64, &[("bi_next", u64t, 0), ("", anon, 16), ("bi_iter", iter, 32)]);
        let btf = Btf::parse(&b.build()).unwrap();
        assert_eq!(btf.member_offset("bio", &["bi_opf"]).unwrap(), 16);
        assert_eq!(btf.member_offset("bio", &["bi_iter", "bi_size"]).unwrap(), 40);
        assert!(btf.has_member("bio", "bi_next"));
        assert!(!btf.has_member("bio", "bi_disk"));
        assert!(matches!(btf.member_offset("bio", &["nope"]), Err(BtfError::NoMember { .. })));
        assert!(matches!(btf.member_offset("request", &["q"]), Err(BtfError::NoStruct(_))));
    }

    #[test]
    fn tracepoint_arguments_name_their_structs() {
        let mut b = Builder::new();
        let u32t = b.int("unsigned int", 4);
        let q = b.fwd("request_queue");
        let rq = b.fwd("request");
        let (qp, rqp) = (b.ptr(q), b.ptr(rq));
        b.tracepoint("block_rq_issue", &[rqp]);
        b.tracepoint("block_rq_insert", &[qp, rqp]);
        b.tracepoint("block_rq_complete", &[rqp, u32t, u32t]);
        let btf = Btf::parse(&b.build()).unwrap();
        assert_eq!(btf.tracepoint_args("block_rq_issue").unwrap(), vec!["request"]);
        assert_eq!(btf.tracepoint_args("block_rq_insert").unwrap(), vec!["request_queue", "request"]);
        assert_eq!(btf.tracepoint_args("block_rq_complete").unwrap(), vec!["request", "", ""]);
        assert!(btf.tracepoint_args("block_nope").is_none());
    }

    #[test]
    fn a_modules_split_btf_continues_the_base_ids_and_strings() {
        let mut base = Builder::new();
        let u16t = base.int("short unsigned int", 2);
        let u64t = base.int("long long unsigned int", 8);
        let bio = base.strukt("bio", 4, 128, &[("bi_next", u64t, 0), ("bi_flags", u16t, 20)]);
        let vmlinux = Btf::parse(&base.build()).unwrap();
        let mut module = Builder::split(&base);
        let io = module.fwd("dm_io");
        let io_ptr = module.ptr(io);
        module.strukt("dm_target_io", 4, 168, &[("magic", u16t, 0), ("io", io_ptr, 8), ("clone", bio, 40)]);
        let btf = Btf::parse_split(&module.build(), &vmlinux).unwrap();
        assert_eq!(btf.member_offset("dm_target_io", &["io"]).unwrap(), 8);
        assert_eq!(btf.member_offset("dm_target_io", &["clone", "bi_flags"]).unwrap(), 60);
        assert_eq!(btf.member_offset("bio", &["bi_flags"]).unwrap(), 20, "the base's types stay");
        assert!(matches!(vmlinux.member_offset("dm_target_io", &["io"]), Err(BtfError::NoStruct(_))));
    }

    #[test]
    fn enumerators_and_malformed_input() {
        let mut b = Builder::new();
        b.enumeration("req_op", &[("REQ_OP_READ", 0), ("REQ_OP_WRITE", 1)]);
        let btf = Btf::parse(&b.build()).unwrap();
        assert_eq!(btf.enumerator("REQ_OP_WRITE"), Some(1));
        assert_eq!(btf.enumerator("REQ_OP_NOPE"), None);
        assert!(Btf::parse(b"garbage").is_err());
        let mut truncated = b.build();
        truncated.truncate(30);
        assert!(Btf::parse(&truncated).is_err());
    }
}
