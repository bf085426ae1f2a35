//! The safetensors file layout: building a header for a set of tensors and parsing/validating
//! the header of an existing file.
//!
//! Layout (identical to safetensors):
//! ```text
//! [u64 little-endian N][N bytes of JSON header, space padded to a multiple of 8][data]
//! ```
//! The JSON header maps tensor names to `{dtype, shape, data_offsets: [begin, end]}` (offsets
//! relative to the start of the data section) and has an optional `__metadata__` str->str map.
//! fastckpt adds two metadata entries: the crc32c of every tensor under [`CHECKSUM_KEY`], and
//! the crc32c of the header itself under [`HEADER_CRC_KEY`], so that no edit of a dtype, shape,
//! offset, checksum or metadata value goes unnoticed (docs/on-disk-format.md, "Header
//! checksum", describes the rules).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::{Map, Value};

use crate::checksum;
use crate::error::{Error, Result, STALE_CHECKSUMS_HINT};
use crate::json;

/// Metadata key holding `{"tensor name": "crc32c as 8 hex digits", ...}` as a JSON string.
pub const CHECKSUM_KEY: &str = "fastckpt.crc32c";
/// Metadata key holding the crc32c (8 lowercase hex digits) of the canonical JSON of the whole
/// header without this entry (see [`header_crc32c`]).
pub const HEADER_CRC_KEY: &str = "fastckpt.header_crc32c";
/// The metadata keys fastckpt writes; user metadata may not use them or anything within
/// [`NEAR_MISS_BYTES`] of them.
pub const RESERVED_KEYS: [&str; 2] = [CHECKSUM_KEY, HEADER_CRC_KEY];
/// A metadata key of the same length as a reserved key differing from it in at most this many
/// bytes is treated as a damaged reserved key: one bit flip changes one byte, and a file that
/// lost its checksum key must not read as a file that never had one.
pub const NEAR_MISS_BYTES: usize = 2;
/// The key safetensors reserves for user metadata.
pub const METADATA_KEY: &str = "__metadata__";
/// Largest header we accept (safetensors uses the same order of magnitude). A file claiming a
/// larger header is refused before anything is allocated.
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;
/// Largest header we write: what the safetensors package reads (a decimal 100 MB, under
/// [`MAX_HEADER_LEN`]), so every file fastckpt writes loads in both.
pub const MAX_WRITTEN_HEADER_LEN: u64 = 100_000_000;
/// Length of the little-endian header-size prefix.
pub const PREFIX_LEN: u64 = 8;
/// Largest number of elements (and stride) a dimension list may describe: frameworks index
/// tensors with signed 64-bit integers.
const MAX_ELEMENTS: u64 = i64::MAX as u64;

/// Element types safetensors knows, with their on-disk names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    C64,
    F8E4M3,
    F8E5M2,
    F8E4M3Fnuz,
    F8E5M2Fnuz,
    F8E8M0,
    /// Two 4-bit values per byte (torch `float4_e2m1fn_x2`; the header counts 4-bit elements).
    F4,
    F6E2M3,
    F6E3M2,
}

impl Dtype {
    /// Every dtype, for tests and for listing in errors.
    pub const ALL: [Dtype; 22] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::U32,
        Dtype::I32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::F64,
        Dtype::C64,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E5M2Fnuz,
        Dtype::F8E8M0,
        Dtype::F4,
        Dtype::F6E2M3,
        Dtype::F6E3M2,
    ];

    /// The safetensors name (`"F32"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::C64 => "C64",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
        }
    }

    /// Parses a safetensors dtype name.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|dtype| dtype.name() == name)
    }

    /// Bits per element.
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E4M3
            | Dtype::F8E5M2
            | Dtype::F8E4M3Fnuz
            | Dtype::F8E5M2Fnuz
            | Dtype::F8E8M0 => 8,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 16,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 32,
            Dtype::U64 | Dtype::I64 | Dtype::F64 | Dtype::C64 => 64,
        }
    }

    /// The dtype's place in the safetensors crate's `Dtype` enum, whose derived order its
    /// writer sorts by (descending): roughly by element size, and for one size in an order of
    /// its own (`U64, I64, F64, C64`, then `F32, U32, I32`, ...).
    pub fn safetensors_rank(self) -> u8 {
        match self {
            Dtype::Bool => 0,
            Dtype::F4 => 1,
            Dtype::F6E2M3 => 2,
            Dtype::F6E3M2 => 3,
            Dtype::U8 => 4,
            Dtype::I8 => 5,
            Dtype::F8E5M2 => 6,
            Dtype::F8E4M3 => 7,
            Dtype::F8E8M0 => 8,
            Dtype::F8E4M3Fnuz => 9,
            Dtype::F8E5M2Fnuz => 10,
            Dtype::I16 => 11,
            Dtype::U16 => 12,
            Dtype::F16 => 13,
            Dtype::Bf16 => 14,
            Dtype::I32 => 15,
            Dtype::U32 => 16,
            Dtype::F32 => 17,
            Dtype::C64 => 18,
            Dtype::F64 => 19,
            Dtype::I64 => 20,
            Dtype::U64 => 21,
        }
    }

    /// Alignment of a tensor's first byte: the element size, one byte for sub-byte types.
    pub fn align(self) -> u64 {
        (self.bits() / 8).max(1)
    }
}

/// Why a dtype and shape do not describe a storable tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeError {
    /// The element count (or a stride) exceeds 2**63 - 1, or the byte count overflows.
    TooLarge,
    /// Sub-byte elements that do not fill whole bytes.
    PartialByte,
}

impl SizeError {
    /// What to tell the user.
    pub fn describe(self) -> &'static str {
        match self {
            SizeError::TooLarge => {
                "the dimensions multiply to more than 2**63 - 1 elements (counting empty \
                 dimensions as 1, as strides do); no framework can index such a tensor"
            }
            SizeError::PartialByte => "the elements do not fill a whole number of bytes",
        }
    }
}

/// Number of bytes a tensor of `dtype` and `shape` occupies.
///
/// The product of the dimensions, with empty ones counted as 1 (that is the largest stride a
/// framework computes), must stay within 2**63 - 1, also for tensors with no elements: a
/// header claiming shape `[0, 2**64 - 1]` describes zero bytes but no loadable tensor.
pub fn tensor_nbytes(dtype: Dtype, shape: &[u64]) -> std::result::Result<u64, SizeError> {
    let mut strides = 1u64;
    let mut numel = 1u64;
    for &dim in shape {
        strides = strides
            .checked_mul(dim.max(1))
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or(SizeError::TooLarge)?;
        numel *= dim; // <= strides, cannot overflow
    }
    let bits = numel.checked_mul(dtype.bits()).ok_or(SizeError::TooLarge)?;
    if bits % 8 != 0 {
        return Err(SizeError::PartialByte);
    }
    Ok(bits / 8)
}

/// The reserved key `key` is a damaged copy of, if any: not equal to it, but equal ignoring
/// ASCII case, or of the same length and differing in at most [`NEAR_MISS_BYTES`] bytes.
pub fn near_reserved_key(key: &str) -> Option<&'static str> {
    RESERVED_KEYS.into_iter().find(|reserved| {
        key != *reserved
            && (key.eq_ignore_ascii_case(reserved)
                || (key.len() == reserved.len()
                    && key
                        .bytes()
                        .zip(reserved.bytes())
                        .filter(|(a, b)| a != b)
                        .count()
                        <= NEAR_MISS_BYTES))
    })
}

/// crc32c of the canonical JSON ([`json::canonical`]) of a parsed header object with the
/// [`HEADER_CRC_KEY`] entry left out of `__metadata__`: what [`HEADER_CRC_KEY`] stores.
pub fn header_crc32c(root: &Map<String, Value>) -> u32 {
    let canonical = json::canonical_without(root, METADATA_KEY, HEADER_CRC_KEY);
    checksum::append(0, canonical.as_bytes())
}

/// Parses 8 lowercase hex digits, the only spelling fastckpt writes (so that even a bit flip
/// that only changes a digit's case is noticed).
fn parse_hex_crc(text: &str) -> Option<u32> {
    let lowercase_hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
    if text.len() == 8 && text.bytes().all(lowercase_hex) {
        u32::from_str_radix(text, 16).ok()
    } else {
        None
    }
}

/// One tensor as described by the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte range inside the data section.
    pub begin: u64,
    pub end: u64,
}

impl TensorInfo {
    /// Size of the tensor's bytes.
    pub fn nbytes(&self) -> u64 {
        self.end - self.begin
    }
}

/// A tensor to be laid out by [`plan_layout`]: name, dtype and shape (its bytes come later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors in data-section order.
    pub tensors: Vec<TensorInfo>,
    /// User metadata, without fastckpt's checksum entry.
    pub metadata: BTreeMap<String, String>,
    /// crc32c per tensor name, when the file was written by fastckpt.
    pub checksums: HashMap<String, u32>,
    /// The verified header checksum, when the file has one (fastckpt writes it since the
    /// on-disk format gained it; older fastckpt files and safetensors files have none).
    pub header_crc32c: Option<u32>,
    /// Absolute file offset where the data section starts.
    pub data_start: u64,
}

impl Header {
    /// Total file length this header describes.
    pub fn file_len(&self) -> u64 {
        self.data_start + self.tensors.last().map_or(0, |t| t.end)
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Validates a user metadata map: fastckpt's reserved keys, and keys a reader would take for a
/// damaged reserved key, are refused.
fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<()> {
    for key in metadata.keys() {
        if RESERVED_KEYS.contains(&key.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "metadata key `{key}` is reserved for fastckpt's checksums; rename it"
            )));
        }
        if let Some(reserved) = near_reserved_key(key) {
            return Err(Error::InvalidArgument(format!(
                "metadata key `{key}` is too close to fastckpt's reserved key `{reserved}` \
                 (readers would take it for a damaged checksum entry); rename it"
            )));
        }
    }
    Ok(())
}

/// Orders tensors exactly as the safetensors writer does (its dtype order descending, then by
/// name; see [`Dtype::safetensors_rank`]), so that every tensor starts at a multiple of its
/// element size and a file re-saved by safetensors with the same tensors has the same offsets
/// (and so the same header checksum); assigns data offsets.
///
/// Returns the tensors in data order with their offsets filled in.
pub fn plan_layout(descs: Vec<TensorDesc>) -> Result<Vec<TensorInfo>> {
    let mut seen = std::collections::HashSet::new();
    for desc in &descs {
        if desc.name == METADATA_KEY {
            return Err(Error::InvalidArgument(format!(
                "tensor name `{METADATA_KEY}` is reserved by the safetensors format; rename it"
            )));
        }
        if !seen.insert(desc.name.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "tensor name `{}` appears twice; names must be unique",
                desc.name
            )));
        }
    }
    let mut descs = descs;
    descs.sort_by(|a, b| {
        b.dtype
            .safetensors_rank()
            .cmp(&a.dtype.safetensors_rank())
            .then_with(|| a.name.cmp(&b.name))
    });
    let mut offset = 0u64;
    let mut tensors = Vec::with_capacity(descs.len());
    for desc in descs {
        let nbytes = tensor_nbytes(desc.dtype, &desc.shape).map_err(|e| {
            Error::InvalidArgument(format!(
                "tensor `{}`: dtype {} x shape {:?}: {}",
                desc.name,
                desc.dtype.name(),
                desc.shape,
                e.describe()
            ))
        })?;
        let end = offset
            .checked_add(nbytes)
            .ok_or_else(|| Error::InvalidArgument("total tensor size overflows u64".to_string()))?;
        tensors.push(TensorInfo {
            name: desc.name,
            dtype: desc.dtype,
            shape: desc.shape,
            begin: offset,
            end,
        });
        offset = end;
    }
    Ok(tensors)
}

/// What [`encode_header`] writes into the checksum metadata entry.
#[derive(Debug, Clone, Copy)]
pub enum Checksums<'a> {
    /// No checksum entry (checksums disabled).
    Omitted,
    /// Zeros of the final width, so the header length is known before hashing.
    Placeholder,
    /// The real crc32c of each tensor, in `tensors` order.
    Values(&'a [u32]),
}

/// An argument error of [`encode_header`] (a header over the size limit, bad metadata) for
/// the file at `path`, named in the message; other errors are returned as they are.
pub fn for_file(path: &Path, error: Error) -> Error {
    match error {
        Error::InvalidArgument(message) => {
            Error::InvalidArgument(format!("{}: {message}", path.display()))
        }
        other => other,
    }
}

/// Serializes the header (prefix + padded JSON) for `tensors` laid out by [`plan_layout`].
///
/// With [`Checksums::Placeholder`] every checksum is written as a placeholder of the same width, so
/// the header length is known before the data is hashed; the final header (with the real
/// checksums) then has exactly the same length and overwrites the placeholder in place.
pub fn encode_header(
    tensors: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    checksums: Checksums,
) -> Result<Vec<u8>> {
    check_metadata(metadata)?;
    let mut meta = Map::new();
    for (key, value) in metadata {
        meta.insert(key.clone(), Value::String(value.clone()));
    }
    let values = match checksums {
        Checksums::Omitted => None,
        Checksums::Placeholder => Some(None),
        Checksums::Values(crcs) => Some(Some(crcs)),
    };
    if let Some(crcs) = values {
        let mut crc_map = Map::new();
        for (i, tensor) in tensors.iter().enumerate() {
            let crc = crcs.map_or(0, |crcs| crcs[i]);
            crc_map.insert(tensor.name.clone(), Value::String(format!("{crc:08x}")));
        }
        meta.insert(
            CHECKSUM_KEY.to_string(),
            Value::String(Value::Object(crc_map).to_string()),
        );
    }
    let mut root = Map::new();
    // Like safetensors, no `__metadata__` at all when there is nothing to put in it.
    if !meta.is_empty() {
        root.insert(METADATA_KEY.to_string(), Value::Object(meta));
    }
    for tensor in tensors {
        let mut entry = Map::new();
        entry.insert("dtype".into(), Value::String(tensor.dtype.name().into()));
        entry.insert(
            "shape".into(),
            Value::Array(tensor.shape.iter().map(|&d| Value::from(d)).collect()),
        );
        entry.insert(
            "data_offsets".into(),
            Value::Array(vec![Value::from(tensor.begin), Value::from(tensor.end)]),
        );
        root.insert(tensor.name.clone(), Value::Object(entry));
    }
    if let Some(crcs) = values {
        // Computed over everything else in the header, this entry included last.
        let header_crc = crcs.map_or(0, |_| header_crc32c(&root));
        if let Some(Value::Object(meta)) = root.get_mut(METADATA_KEY) {
            meta.insert(
                HEADER_CRC_KEY.to_string(),
                Value::String(format!("{header_crc:08x}")),
            );
        }
    }
    let mut json = Value::Object(root).to_string().into_bytes();
    // Pad with spaces so the data section starts 8-byte aligned (valid JSON whitespace).
    let padded = json.len().div_ceil(8) * 8;
    if padded as u64 > MAX_WRITTEN_HEADER_LEN {
        return Err(Error::InvalidArgument(format!(
            "the header ({} tensor names, shapes and checksums, and the metadata) would take \
             {padded} bytes, over the {MAX_WRITTEN_HEADER_LEN} bytes safetensors readers accept: \
             split the tensors across files (checkpoint items), shorten their names, or keep \
             large metadata values in a file of their own",
            tensors.len()
        )));
    }
    json.resize(padded, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Pads an [`encode_header`] result with spaces (valid JSON whitespace, which readers trim)
/// to exactly `len` bytes, prefix included, and rewrites the prefix: the data section then
/// starts at `len`. Fails when the header is already longer, or `len` is not a multiple of 8.
pub fn pad_header(header: &mut Vec<u8>, len: u64) -> Result<()> {
    if (header.len() as u64) > len || len % 8 != 0 || len > PREFIX_LEN + MAX_HEADER_LEN {
        return Err(Error::InvalidArgument(format!(
            "a {}-byte header cannot be padded to {len} bytes",
            header.len()
        )));
    }
    header.resize(len as usize, b' ');
    header[..PREFIX_LEN as usize].copy_from_slice(&(len - PREFIX_LEN).to_le_bytes());
    Ok(())
}

/// Reads the header length from the 8-byte prefix and checks it against the cap and the file.
pub fn parse_prefix(path: &Path, prefix: &[u8; 8], file_len: u64) -> Result<u64> {
    let header_len = u64::from_le_bytes(*prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(Error::format(
            path,
            "header_length",
            format!(
                "declares a {header_len}-byte header, over the {MAX_HEADER_LEN}-byte limit; \
                 this is not a safetensors file or it is corrupt"
            ),
        ));
    }
    if PREFIX_LEN + header_len > file_len {
        return Err(Error::format(
            path,
            "header_length",
            format!(
                "declares a {header_len}-byte header but the file has only {file_len} bytes; \
                 the file is truncated"
            ),
        ));
    }
    Ok(header_len)
}

fn parse_shape(path: &Path, name: &str, value: Option<&Value>) -> Result<Vec<u64>> {
    let field = format!("{name}.shape");
    let dims = value
        .and_then(Value::as_array)
        .ok_or_else(|| Error::format(path, &field, "missing or not a list"))?;
    dims.iter()
        .map(|dim| {
            dim.as_u64()
                .ok_or_else(|| Error::format(path, &field, "dimensions must be integers >= 0"))
        })
        .collect()
}

fn parse_offsets(path: &Path, name: &str, value: Option<&Value>) -> Result<(u64, u64)> {
    let field = format!("{name}.data_offsets");
    let pair = value
        .and_then(Value::as_array)
        .filter(|pair| pair.len() == 2)
        .ok_or_else(|| Error::format(path, &field, "missing or not a [begin, end] pair"))?;
    match (pair[0].as_u64(), pair[1].as_u64()) {
        (Some(begin), Some(end)) if begin <= end => Ok((begin, end)),
        _ => Err(Error::format(
            path,
            &field,
            "offsets must be integers with begin <= end",
        )),
    }
}

fn parse_checksums(path: &Path, text: &str) -> Result<HashMap<String, u32>> {
    let bad = |msg: &str| Error::format(path, CHECKSUM_KEY, msg.to_string());
    let value = json::parse_strict(text).map_err(|e| bad(&format!("not valid JSON: {e}")))?;
    let object = value.as_object().ok_or_else(|| bad("not a JSON object"))?;
    object
        .iter()
        .map(|(name, crc)| {
            let crc = crc
                .as_str()
                .and_then(parse_hex_crc)
                .ok_or_else(|| bad(&format!("entry `{name}` is not 8 lowercase hex digits")))?;
            Ok((name.clone(), crc))
        })
        .collect()
}

/// User metadata, tensor checksums and the header checksum found in `__metadata__` (all empty
/// for a header without one).
#[derive(Default)]
struct Metadata {
    user: BTreeMap<String, String>,
    checksums: Option<HashMap<String, u32>>,
    header_crc: Option<u32>,
}

fn parse_metadata(path: &Path, value: &Value) -> Result<Metadata> {
    let object = value
        .as_object()
        .ok_or_else(|| Error::format(path, METADATA_KEY, "must be a str -> str mapping"))?;
    let mut parsed = Metadata::default();
    for (key, value) in object {
        let field = format!("{METADATA_KEY}.{key}");
        let text = value
            .as_str()
            .ok_or_else(|| Error::format(path, &field, "metadata values must be strings"))?;
        if key == CHECKSUM_KEY {
            parsed.checksums = Some(parse_checksums(path, text)?);
        } else if key == HEADER_CRC_KEY {
            parsed.header_crc = Some(parse_hex_crc(text).ok_or_else(|| {
                Error::format(path, HEADER_CRC_KEY, "not 8 lowercase hex digits")
            })?);
        } else if let Some(reserved) = near_reserved_key(key) {
            return Err(Error::format(
                path,
                field,
                format!(
                    "looks like fastckpt's `{reserved}` key with damaged bytes: the header is \
                     corrupt (restore the file or load an older checkpoint)"
                ),
            ));
        } else {
            parsed.user.insert(key.clone(), text.to_string());
        }
    }
    if parsed.header_crc.is_some() && parsed.checksums.is_none() {
        return Err(Error::format(
            path,
            CHECKSUM_KEY,
            format!("missing although `{HEADER_CRC_KEY}` is present: the header is corrupt"),
        ));
    }
    Ok(parsed)
}

/// One tensor entry of the header, validated on its own.
fn parse_tensor(path: &Path, name: &str, entry: &Value) -> Result<TensorInfo> {
    let entry = entry.as_object().ok_or_else(|| {
        Error::format(path, name, "must be an object {dtype, shape, data_offsets}")
    })?;
    let dtype = match entry.get("dtype") {
        None => return Err(Error::format(path, format!("{name}.dtype"), "missing")),
        Some(Value::String(dtype_name)) => Dtype::from_name(dtype_name).ok_or_else(|| {
            Error::format(
                path,
                format!("{name}.dtype"),
                format!("unknown dtype `{dtype_name}`"),
            )
        })?,
        Some(other) => {
            return Err(Error::format(
                path,
                format!("{name}.dtype"),
                format!("must be a dtype name such as \"F32\", got {other}"),
            ))
        }
    };
    let shape = parse_shape(path, name, entry.get("shape"))?;
    let (begin, end) = parse_offsets(path, name, entry.get("data_offsets"))?;
    let expected = tensor_nbytes(dtype, &shape).map_err(|e| {
        Error::format(
            path,
            format!("{name}.shape"),
            format!("{shape:?} with dtype {}: {}", dtype.name(), e.describe()),
        )
    })?;
    if end - begin != expected {
        return Err(Error::format(
            path,
            format!("{name}.data_offsets"),
            format!(
                "covers {} bytes but dtype {} x shape {:?} needs {expected}",
                end - begin,
                dtype.name(),
                shape
            ),
        ));
    }
    Ok(TensorInfo {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

/// Parses and validates the JSON header of a file of `file_len` bytes.
///
/// Checks: valid UTF-8 JSON object without duplicate keys; the header checksum, when present,
/// matches (checked first: any edit of a fastckpt header is reported as such); no metadata key
/// is a damaged copy of a reserved one; every entry has a known dtype, integer shape and
/// offsets; `end - begin == dtype size x numel`; tensors tile the data section without gaps or
/// overlaps from offset 0; the data section ends exactly at the end of the file (a shorter
/// file is truncated, a longer one is not something we wrote); checksums name real tensors.
pub fn parse_header(path: &Path, json: &[u8], file_len: u64) -> Result<Header> {
    let data_start = PREFIX_LEN + json.len() as u64;
    let text = std::str::from_utf8(json)
        .map_err(|_| Error::format(path, "header", "header is not valid UTF-8"))?;
    let root = json::parse_strict(text.trim_end_matches(' '))
        .map_err(|err| Error::format(path, "header", format!("invalid JSON: {err}")))?;
    let root = root
        .as_object()
        .ok_or_else(|| Error::format(path, "header", "header must be a JSON object"))?;
    let metadata = match root.get(METADATA_KEY) {
        // `null` is no metadata, as safetensors reads it: MLX writes it for a file saved
        // without metadata. Such a file has no checksums, as one without the entry.
        None | Some(Value::Null) => Metadata::default(),
        Some(value) => parse_metadata(path, value)?,
    };
    if let Some(stored) = metadata.header_crc {
        let actual = header_crc32c(root);
        if actual != stored {
            return Err(Error::format(
                path,
                HEADER_CRC_KEY,
                format!(
                    "the header does not match its checksum (stored {stored:08x}, computed \
                     {actual:08x}): a dtype, shape, offset, checksum or metadata entry was \
                     changed; the file is corrupt: restore it or load an older checkpoint \
                     {STALE_CHECKSUMS_HINT}"
                ),
            ));
        }
    }
    let mut tensors = Vec::with_capacity(root.len());
    for (name, entry) in root {
        if name != METADATA_KEY {
            tensors.push(parse_tensor(path, name, entry)?);
        }
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut cursor = 0u64;
    for tensor in &tensors {
        if tensor.begin != cursor {
            let what = if tensor.begin < cursor {
                "overlaps the previous tensor"
            } else {
                "leaves a gap after the previous tensor"
            };
            return Err(Error::format(
                path,
                format!("{}.data_offsets", tensor.name),
                format!("starts at {} which {what} (ends at {cursor})", tensor.begin),
            ));
        }
        cursor = tensor.end;
    }
    let described = data_start.saturating_add(cursor);
    if described != file_len {
        let problem = if described > file_len {
            "the file is truncated"
        } else {
            "the file has trailing bytes the header does not describe"
        };
        return Err(Error::format(
            path,
            "data_offsets",
            format!("header describes {described} bytes but the file has {file_len}: {problem}"),
        ));
    }
    let checksums = metadata.checksums.unwrap_or_default();
    if let Some(unknown) = checksums.keys().find(|name| !root.contains_key(*name)) {
        return Err(Error::format(
            path,
            CHECKSUM_KEY,
            format!("checksum for unknown tensor `{unknown}`"),
        ));
    }
    if metadata.header_crc.is_some() {
        if let Some(missing) = tensors.iter().find(|t| !checksums.contains_key(&t.name)) {
            return Err(Error::format(
                path,
                CHECKSUM_KEY,
                format!(
                    "no checksum for tensor `{}`: the header is corrupt",
                    missing.name
                ),
            ));
        }
    }
    Ok(Header {
        tensors,
        metadata: metadata.user,
        checksums,
        header_crc32c: metadata.header_crc,
        data_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(name: &str, dtype: Dtype, shape: &[u64]) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    fn encode(descs: Vec<TensorDesc>, crcs: Option<&[u32]>) -> (Vec<TensorInfo>, Vec<u8>) {
        let tensors = plan_layout(descs).unwrap();
        let zeros = vec![0; tensors.len()];
        let header = encode_header(
            &tensors,
            &BTreeMap::new(),
            Checksums::Values(crcs.unwrap_or(&zeros)),
        )
        .unwrap();
        (tensors, header)
    }

    fn parse(bytes: &[u8]) -> Result<Header> {
        let path = Path::new("t.safetensors");
        let prefix: [u8; 8] = bytes[..8].try_into().unwrap();
        let len = parse_prefix(path, &prefix, bytes.len() as u64)?;
        parse_header(path, &bytes[8..8 + len as usize], bytes.len() as u64)
    }

    fn file_with_data(header: &[u8], data_len: u64) -> Vec<u8> {
        let mut file = header.to_vec();
        file.resize(header.len() + data_len as usize, 0);
        file
    }

    #[test]
    fn dtype_names_round_trip_and_sizes() {
        for dtype in Dtype::ALL {
            assert_eq!(Dtype::from_name(dtype.name()), Some(dtype));
        }
        assert_eq!(Dtype::Bf16.bits(), 16);
        assert_eq!(Dtype::F8E4M3.align(), 1);
        assert_eq!(Dtype::F4.align(), 1);
        assert_eq!(Dtype::from_name("F8_E8M0"), Some(Dtype::F8E8M0));
        assert_eq!(Dtype::from_name("F128"), None);
    }

    #[test]
    fn safetensors_order_never_puts_a_smaller_alignment_first() {
        for a in Dtype::ALL {
            for b in Dtype::ALL {
                if a.safetensors_rank() > b.safetensors_rank() {
                    assert!(a.align() >= b.align(), "{} before {}", a.name(), b.name());
                }
            }
            let same = Dtype::ALL
                .iter()
                .filter(|d| d.safetensors_rank() == a.safetensors_rank());
            assert_eq!(same.count(), 1, "{}", a.name());
        }
    }

    #[test]
    fn layout_sorts_by_alignment_then_name_and_is_contiguous() {
        let tensors = plan_layout(vec![
            desc("b", Dtype::U8, &[3]),
            desc("a", Dtype::F64, &[2]),
            desc("c", Dtype::F32, &[]),
            desc("z", Dtype::F16, &[0, 4]),
        ])
        .unwrap();
        let names: Vec<_> = tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "c", "z", "b"]);
        assert_eq!((tensors[0].begin, tensors[0].end), (0, 16));
        assert_eq!((tensors[1].begin, tensors[1].end), (16, 20));
        assert_eq!((tensors[2].begin, tensors[2].end), (20, 20));
        assert_eq!((tensors[3].begin, tensors[3].end), (20, 23));
    }

    #[test]
    fn duplicate_and_reserved_names_are_refused() {
        let dup = plan_layout(vec![desc("a", Dtype::U8, &[1]), desc("a", Dtype::U8, &[1])]);
        assert!(matches!(dup, Err(Error::InvalidArgument(m)) if m.contains("twice")));
        let reserved = plan_layout(vec![desc(METADATA_KEY, Dtype::U8, &[1])]);
        assert!(matches!(reserved, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn header_is_padded_to_eight_and_placeholder_has_final_length() {
        let (tensors, placeholder) = encode(
            vec![desc("w", Dtype::F32, &[3, 3]), desc("b", Dtype::I64, &[3])],
            None,
        );
        let fin = encode_header(
            &tensors,
            &BTreeMap::new(),
            Checksums::Values(&[0xdeadbeef, 7]),
        )
        .unwrap();
        assert_eq!(placeholder.len(), fin.len());
        assert_eq!(fin.len() % 8, 0);
        let json_len = u64::from_le_bytes(fin[..8].try_into().unwrap());
        assert_eq!(json_len as usize, fin.len() - 8);
    }

    #[test]
    fn round_trip_header_with_metadata_and_checksums() {
        let tensors = plan_layout(vec![
            desc("w", Dtype::Bf16, &[2, 5]),
            desc("s", Dtype::Bool, &[]),
        ])
        .unwrap();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let header = encode_header(&tensors, &meta, Checksums::Values(&[1, 0xffff_ffff])).unwrap();
        let file = file_with_data(&header, 21);
        let parsed = parse(&file).unwrap();
        assert_eq!(parsed.tensors, tensors);
        assert_eq!(parsed.metadata, meta);
        assert_eq!(parsed.checksums["w"], 1);
        assert_eq!(parsed.checksums["s"], 0xffff_ffff);
        assert_eq!(parsed.data_start as usize, header.len());
        assert_eq!(parsed.file_len(), file.len() as u64);
    }

    #[test]
    fn reserved_metadata_key_is_refused() {
        let mut meta = BTreeMap::new();
        meta.insert(CHECKSUM_KEY.to_string(), "x".to_string());
        assert!(encode_header(&[], &meta, Checksums::Omitted).is_err());
    }

    fn raw_file(json: &str, data_len: usize) -> Vec<u8> {
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.resize(file.len() + data_len, 0);
        file
    }

    fn format_field(result: Result<Header>) -> String {
        match result {
            Err(Error::Format { field, .. }) => field,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    #[test]
    fn malformed_headers_are_typed_errors_naming_the_field() {
        let cases: &[(&str, usize, &str)] = &[
            ("not json", 0, "header"),
            ("[1,2]", 0, "header"),
            (
                r#"{"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}"#,
                4,
                "a.dtype",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                4,
                "a.shape",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
                4,
                "a.data_offsets",
            ),
            (r#"{"a":{"dtype":"F32","shape":[1]}}"#, 4, "a.data_offsets"),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                4,
                "a.data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                6,
                "b.data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}}"#,
                5,
                "a.data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                3,
                "data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                9,
                "data_offsets",
            ),
            (r#"{"__metadata__":{"k":1}}"#, 0, "__metadata__.k"),
            (
                r#"{"__metadata__":{"fastckpt.crc32c":"{\"zz\":\"00000000\"}"}}"#,
                0,
                CHECKSUM_KEY,
            ),
            (
                r#"{"__metadata__":{"fastckpt.crc32c":"nope"}}"#,
                0,
                CHECKSUM_KEY,
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,4]}}"#,
                4,
                "a.shape",
            ),
        ];
        for (json, data_len, field) in cases {
            let got = format_field(parse(&raw_file(json, *data_len)));
            assert_eq!(&got, field, "for header {json}");
        }
        // A missing or non-string dtype says so (before: "unknown dtype ``").
        for (json, said) in [
            (r#"{"a":{"shape":[1],"data_offsets":[0,1]}}"#, "missing"),
            (
                r#"{"a":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#,
                "got 7",
            ),
        ] {
            let err = parse(&raw_file(json, 1)).unwrap_err().to_string();
            assert!(err.contains("a.dtype") && err.contains(said), "{err}");
        }
    }

    #[test]
    fn element_counts_beyond_i64_are_refused_even_when_empty() {
        let field = format_field(parse(&raw_file(
            r#"{"a":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}}"#,
            0,
        )));
        assert_eq!(field, "a.shape");
        let max = i64::MAX as u64;
        assert_eq!(tensor_nbytes(Dtype::F32, &[0, max]), Ok(0));
        assert_eq!(
            tensor_nbytes(Dtype::U8, &[0, 1 << 62, 2]),
            Err(SizeError::TooLarge)
        );
        assert_eq!(
            tensor_nbytes(Dtype::U64, &[1 << 62]),
            Err(SizeError::TooLarge)
        );
    }

    #[test]
    fn sub_byte_dtypes_need_whole_bytes() {
        assert_eq!(tensor_nbytes(Dtype::F4, &[2, 4]), Ok(4));
        assert_eq!(tensor_nbytes(Dtype::F4, &[3]), Err(SizeError::PartialByte));
        assert_eq!(tensor_nbytes(Dtype::F6E2M3, &[4]), Ok(3));
        let refused = plan_layout(vec![desc("q", Dtype::F4, &[1])]);
        assert!(matches!(refused, Err(Error::InvalidArgument(m)) if m.contains("whole number")));
    }

    #[test]
    fn metadata_keys_close_to_reserved_ones_are_refused_on_write() {
        for key in [
            CHECKSUM_KEY,
            HEADER_CRC_KEY,
            "fastckpt.crc32d",
            "FASTCKPT.CRC32C",
        ] {
            let meta = BTreeMap::from([(key.to_string(), "x".to_string())]);
            let refused = encode_header(&[], &meta, Checksums::Omitted);
            assert!(matches!(refused, Err(Error::InvalidArgument(_))), "{key}");
        }
        let fine = BTreeMap::from([("fastckpt.source".to_string(), "x".to_string())]);
        assert!(encode_header(&[], &fine, Checksums::Omitted).is_ok());
    }

    #[test]
    fn for_file_names_the_file_of_an_argument_error_only() {
        let meta = BTreeMap::from([(CHECKSUM_KEY.to_string(), "x".to_string())]);
        let Err(refused) = encode_header(&[], &meta, Checksums::Omitted) else {
            panic!("a reserved metadata key was accepted")
        };
        let plain = refused.to_string();
        let named = for_file(Path::new("/ckpt/a.safetensors"), refused).to_string();
        assert_eq!(named, format!("/ckpt/a.safetensors: {plain}"));
        let io = Error::Io {
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(5),
        };
        let kept = for_file(Path::new("/ckpt/a.safetensors"), io).to_string();
        assert!(kept.starts_with("/x: "), "{kept}");
    }

    #[test]
    fn no_metadata_object_without_metadata_or_checksums() {
        let tensors = plan_layout(vec![desc("a", Dtype::U8, &[1])]).unwrap();
        let header = encode_header(&tensors, &BTreeMap::new(), Checksums::Omitted).unwrap();
        let json = std::str::from_utf8(&header[8..]).unwrap();
        assert!(!json.contains(METADATA_KEY), "{json}");
    }

    #[test]
    fn null_metadata_is_a_header_without_metadata() {
        // MLX writes `"__metadata__":null` for a file saved without metadata, and safetensors
        // reads it as none. Before, it was refused: "must be a str -> str mapping".
        let tensor = r#""a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}"#;
        let with_null = parse(&raw_file(
            &format!(r#"{{"__metadata__":null,{tensor}}}"#),
            2,
        ));
        let without = parse(&raw_file(&format!("{{{tensor}}}"), 2)).unwrap();
        let with_null = with_null.unwrap();
        assert_eq!(with_null.tensors, without.tensors);
        assert!(with_null.metadata.is_empty() && with_null.checksums.is_empty());
        assert_eq!(with_null.header_crc32c, None);
        // Any other value that is not a str -> str mapping is still refused, as in safetensors.
        for value in ["[]", r#""x""#, "1", "false", r#"{"k":null}"#] {
            let json = format!(r#"{{"__metadata__":{value},{tensor}}}"#);
            let field = format_field(parse(&raw_file(&json, 2)));
            assert!(field.starts_with(METADATA_KEY), "{value}: {field}");
        }
    }

    #[test]
    fn checksum_mismatches_name_the_keys_another_tool_may_have_copied() {
        // A file re-saved by safetensors with `metadata=f.metadata()` of a fastckpt file keeps
        // stale checksums. Before, the errors only said "the file is corrupt: restore it".
        let tensors = plan_layout(vec![desc("w", Dtype::F32, &[2])]).unwrap();
        let header = encode_header(&tensors, &BTreeMap::new(), Checksums::Values(&[7])).unwrap();
        let mut edited = file_with_data(&header, 8);
        let at = edited.windows(5).position(|w| w == br#""F32""#).unwrap();
        edited[at..at + 5].copy_from_slice(br#""I32""#);
        let data = Error::Checksum {
            path: "t.safetensors".into(),
            tensor: "w".into(),
            expected: 7,
            actual: 8,
        };
        for message in [parse(&edited).unwrap_err().to_string(), data.to_string()] {
            assert!(message.contains("the file is corrupt"), "{message}");
            for key in RESERVED_KEYS {
                assert!(message.contains(&format!("`{key}`")), "{message}");
            }
            assert!(message.contains("drop both keys"), "{message}");
        }
    }

    #[test]
    fn the_header_checksum_is_the_crc_of_the_canonical_header_without_it() {
        let tensors = plan_layout(vec![desc("w", Dtype::F32, &[2])]).unwrap();
        let header = encode_header(&tensors, &BTreeMap::new(), Checksums::Values(&[7])).unwrap();
        let parsed = parse(&file_with_data(&header, 8)).unwrap();
        let canonical = concat!(
            r#"{"__metadata__":{"fastckpt.crc32c":"{\"w\":\"00000007\"}"},"#,
            r#""w":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}}"#
        );
        assert_eq!(
            parsed.header_crc32c,
            Some(checksum::append(0, canonical.as_bytes()))
        );
    }

    #[test]
    fn huge_or_truncated_header_length_is_refused_without_allocating() {
        let path = Path::new("t");
        let huge = u64::MAX.to_le_bytes();
        assert!(matches!(
            parse_prefix(path, &huge, 100),
            Err(Error::Format { .. })
        ));
        let over_file = 50u64.to_le_bytes();
        assert!(matches!(
            parse_prefix(path, &over_file, 40),
            Err(Error::Format { .. })
        ));
        assert_eq!(parse_prefix(path, &32u64.to_le_bytes(), 40).unwrap(), 32);
    }

    #[test]
    fn empty_file_set_is_valid() {
        let (_, header) = encode(vec![], None);
        let parsed = parse(&header).unwrap();
        assert!(parsed.tensors.is_empty());
    }

    proptest::proptest! {
        #[test]
        fn any_layout_round_trips(shapes in proptest::collection::vec(
            (0usize..Dtype::ALL.len(), proptest::collection::vec(0u64..5, 0..4)), 0..12)) {
            let descs: Vec<_> = shapes.iter().enumerate().map(|(i, (d, shape))| {
                desc(&format!("t{i}"), Dtype::ALL[*d], shape)
            }).filter(|d| tensor_nbytes(d.dtype, &d.shape).is_ok()).collect();
            let (tensors, header) = encode(descs, None);
            let data_len = tensors.last().map_or(0, |t| t.end);
            let parsed = parse(&file_with_data(&header, data_len)).unwrap();
            for t in &parsed.tensors {
                proptest::prop_assert_eq!(t.begin % t.dtype.align(), 0);
            }
            proptest::prop_assert_eq!(parsed.tensors.len(), tensors.len());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let path = Path::new("fuzz");
            let _ = parse_header(path, &bytes, bytes.len() as u64 + 8);
        }
    }

    /// Mutations of a real header: whatever the damage, parsing returns `Err` or a header that
    /// describes exactly the bytes present, and never panics or allocates what a length claims.
    mod mutated {
        use super::*;
        use proptest::prelude::*;

        /// A header fastckpt writes (several dtypes, a 0-d and a zero-size tensor, checksums,
        /// user metadata) followed by its data section.
        fn real_file() -> Vec<u8> {
            let tensors = plan_layout(vec![
                desc("weight", Dtype::F32, &[4, 3]),
                desc("bias", Dtype::Bf16, &[3]),
                desc("step", Dtype::I64, &[]),
                desc("mask", Dtype::Bool, &[0, 5]),
            ])
            .unwrap();
            let mut meta = BTreeMap::new();
            meta.insert("format".to_string(), "pt".to_string());
            let crcs: Vec<u32> = (0..tensors.len() as u32).map(|i| 0x1234_5678 ^ i).collect();
            let header = encode_header(&tensors, &meta, Checksums::Values(&crcs)).unwrap();
            file_with_data(&header, tensors.last().map_or(0, |t| t.end))
        }

        /// What `Reader::open` does with a whole file, for inputs of any length.
        fn parse_file(bytes: &[u8]) -> Result<Header> {
            let path = Path::new("mutated.safetensors");
            let file_len = bytes.len() as u64;
            let Some(prefix) = bytes.get(..8).and_then(|p| <[u8; 8]>::try_from(p).ok()) else {
                return Err(Error::format(
                    path,
                    "header_length",
                    "shorter than the prefix",
                ));
            };
            let len = parse_prefix(path, &prefix, file_len)?;
            parse_header(path, &bytes[8..8 + len as usize], file_len)
        }

        fn consistent(header: &Header, file_len: u64) -> std::result::Result<(), TestCaseError> {
            prop_assert_eq!(header.file_len(), file_len);
            let mut cursor = 0;
            for tensor in &header.tensors {
                prop_assert_eq!(tensor.begin, cursor);
                prop_assert_eq!(
                    Ok(tensor.nbytes()),
                    tensor_nbytes(tensor.dtype, &tensor.shape)
                );
                cursor = tensor.end;
            }
            for name in header.checksums.keys() {
                prop_assert!(header.tensor(name).is_some());
            }
            Ok(())
        }

        /// Rewrites the JSON of `file` through `edit`, with a consistent length prefix.
        fn edit_json(file: &[u8], edit: impl FnOnce(&str) -> String) -> Vec<u8> {
            let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
            let json = std::str::from_utf8(&file[8..8 + len]).unwrap();
            let mut edited = edit(json.trim_end()).into_bytes();
            edited.resize(edited.len().div_ceil(8) * 8, b' ');
            let mut out = (edited.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&edited);
            out.extend_from_slice(&file[8 + len..]);
            out
        }

        fn failed_field(result: Result<Header>) -> String {
            match result {
                Err(Error::Format { field, .. }) => field,
                other => panic!("expected a format error, got {other:?}"),
            }
        }

        #[test]
        fn every_single_bit_flip_in_the_header_is_refused() {
            let file = real_file();
            let header_end = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
            for position in 0..header_end {
                for bit in 0..8 {
                    let mut damaged = file.clone();
                    damaged[position] ^= 1 << bit;
                    assert!(
                        parse_file(&damaged).is_err(),
                        "flipping bit {bit} of byte {position} ({:?}) went unnoticed",
                        file[position] as char
                    );
                }
            }
        }

        #[test]
        fn a_damaged_checksum_key_is_not_a_file_without_checksums() {
            let file = real_file();
            for (key, damaged) in [
                (CHECKSUM_KEY, "fastckpt.crb32c"),
                (CHECKSUM_KEY, "Fastckpt.crc32c"),
                (HEADER_CRC_KEY, "fastckpt.header_crc32b"),
            ] {
                let edited = edit_json(&file, |json| json.replace(key, damaged));
                let field = failed_field(parse_file(&edited));
                assert!(field.ends_with(damaged), "{damaged}: {field}");
            }
        }

        #[test]
        fn edits_of_empty_shapes_dtypes_and_checksums_are_refused() {
            let file = real_file();
            for (from, to) in [
                (r#""shape":[0,5]"#, r#""shape":[5,0]"#),
                (r#""dtype":"F32""#, r#""dtype":"I32""#),
                (r#""format":"pt""#, r#""format":"np""#),
                ("12345678", "12345679"),
            ] {
                assert!(
                    file.windows(from.len()).any(|w| w == from.as_bytes()),
                    "{from}"
                );
                let edited = edit_json(&file, |json| json.replacen(from, to, 1));
                assert_eq!(failed_field(parse_file(&edited)), HEADER_CRC_KEY, "{from}");
            }
        }

        #[test]
        fn a_duplicate_metadata_object_is_refused() {
            let file = real_file();
            let edited = edit_json(&file, |json| {
                format!(r#"{{"__metadata__":{{}},{}"#, &json[1..])
            });
            let err = parse_file(&edited).unwrap_err().to_string();
            assert!(err.contains("duplicate key `__metadata__`"), "{err}");
        }

        #[test]
        fn the_unmutated_file_parses() {
            let file = real_file();
            let header = parse_file(&file).unwrap();
            assert_eq!(header.tensors.len(), 4);
            assert_eq!(header.file_len(), file.len() as u64);
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2048))]

            #[test]
            fn bit_flips_byte_changes_and_truncations_never_panic(
                flips in proptest::collection::vec((any::<usize>(), 0u8..8), 0..6),
                bytes in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
                cut in proptest::option::of(any::<usize>()),
            ) {
                let mut file = real_file();
                let header_end = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
                for (position, bit) in flips {
                    file[position % header_end] ^= 1 << bit; // the prefix and the JSON header
                }
                for (position, byte) in bytes {
                    let i = position % file.len();
                    file[i] = byte;
                }
                if let Some(cut) = cut {
                    file.truncate(cut % (file.len() + 1));
                }
                if let Ok(header) = parse_file(&file) {
                    consistent(&header, file.len() as u64)?;
                }
            }

            #[test]
            fn declared_lengths_over_the_cap_are_refused(
                len in (MAX_HEADER_LEN + 1)..=u64::MAX,
                file_len in any::<u64>(),
            ) {
                let refused = parse_prefix(Path::new("huge"), &len.to_le_bytes(), file_len);
                let is_format_error = matches!(refused, Err(Error::Format { .. }));
                prop_assert!(is_format_error, "{:?}", refused);
            }

            #[test]
            fn declared_lengths_beyond_the_file_are_refused(
                file_len in 0u64..(1 << 40),
                excess in 1u64..(1 << 30),
            ) {
                let len = file_len.saturating_sub(PREFIX_LEN) + excess;
                let refused = parse_prefix(Path::new("short"), &len.to_le_bytes(), file_len);
                let is_format_error = matches!(refused, Err(Error::Format { .. }));
                prop_assert!(is_format_error, "{:?}", refused);
            }

            #[test]
            fn a_prefix_claiming_a_huge_length_fails_the_whole_file(
                len in (MAX_HEADER_LEN + 1)..=u64::MAX,
            ) {
                let mut file = real_file();
                file[..8].copy_from_slice(&len.to_le_bytes());
                let refused = parse_file(&file);
                let is_format_error = matches!(refused, Err(Error::Format { .. }));
                prop_assert!(is_format_error, "{:?}", refused);
            }
        }
    }
}
