// Copyright (c) 2015-2024 Georg Brandl.  Licensed under the Apache License,
// Version 2.0 <LICENSE-APACHE or http://www.apache.org/licenses/LICENSE-2.0>
// or the MIT license <LICENSE-MIT or http://opensource.org/licenses/MIT>, at
// your option. This file may not be copied, modified, or distributed except
// according to those terms.

//! # Pickle deserialization
//!
//! Note: Serde's interface doesn't support all of Python's primitive types.  In
//! order to deserialize a pickle stream to `value::Value`, use the
//! `value_from_*` functions exported here, not the generic `from_*` functions.

use byteorder::{BigEndian, ByteOrder, LittleEndian};
use iter_read::{IterRead, IterReadItem};
use num_bigint::{BigInt, Sign};
use num_traits::ToPrimitive;
use serde::de::Visitor;
use serde::{de, forward_to_deserialize_any};
use std::char;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::io::{BufRead, BufReader, Read};
use std::iter::FusedIterator;
use std::mem;
use std::str;
use std::str::FromStr;

use super::consts::*;
use super::error::{Error, ErrorCode, Result};
use super::value;

type MemoId = u32;

/// oomprobe's patch: the pickle memo, by id (value, number of refs), hashed by a multiply:
/// SipHash of the id dominated reading a large pickle.
type Memo = HashMap<MemoId, MemoEntry, BuildHasherDefault<IdHasher>>;

/// oomprobe's patch: one memoized value and how many references to it there are. The cells let
/// a walk take out a value visited for the last time while it reads others (`Walk::resolved`).
struct MemoEntry {
    value: RefCell<Value>,
    /// While parsing: the stream's references (upstream's count). While walking: the
    /// references in the value walked and in the memo, or -1 once the walk took the value.
    refs: Cell<i32>,
}

/// Hashes a memo id (Fibonacci hashing: the id times 2^64 / golden ratio).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// oomprobe's patch: the newtype-struct name by which a type asks to learn whether its value is
/// a memoized object, and which. `deserialize_newtype_struct(MEMO_ID, visitor)` on this crate's
/// deserializer calls `visitor.visit_seq` with two elements: the memo id (a `u64`, `u64::MAX`
/// when the value is not a memo reference) and the value itself, which the visitor may leave
/// unread (it has read the same memo id before). Other deserializers call
/// `visit_newtype_struct` as usual. The ids are those of one `from_*` call.
pub const MEMO_ID: &str = "serde_pickle::MemoId";

/// oomprobe's patch: a function that may take the items appended to a memoized list while the
/// stream is parsed (`DeOptions::take_list_items`), so that a long list of dicts is not held
/// whole as parsed values before it is converted. It is called with the list's memo id and a
/// deserializer over the appended item, already complete (a pickle refers only to what came
/// before). `Ok(true)`: the caller took the item; it is dropped from the parse and reads back
/// as unit (`visit_unit`) where the list is walked later; its memo entry is removed, and the
/// values read through [`MEMO_ID`] while it was taken are dropped from the memo (a reader of
/// `MEMO_ID` keeps what it read by id and does not read the value again). `Ok(false)`: the item
/// stays. `Err`: the parse fails with it.
pub type TakeListItem = fn(list: u64, item: Walk<'_>) -> Result<bool>;

#[derive(Clone, Debug, PartialEq)]
enum Global {
    Set,       // builtins/__builtin__.set
    Frozenset, // builtins/__builtin__.frozenset
    Bytearray, // builtins/__builtin__.bytearray
    List,      // builtins/__builtin__.list
    Int,       // builtins/__builtin__.int
    Encode,    // _codecs.encode
    Reconst,   // copy_reg._reconstructor
    Other,     // anything else (may be a classobj that is later discarded)
}

/// Our intermediate representation of a value.
///
/// The most striking difference to `value::Value` is that it contains a variant
/// for `MemoRef`, which references values put into the "memo" map, and a variant
/// for module globals that we support.
///
/// We also don't use sets and maps at the Rust level, since they are not
/// needed: nothing is ever looked up in them at this stage, and Vecs are much
/// tighter in memory.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    MemoRef(MemoId),
    Global(Global),
    None,
    Bool(bool),
    I64(i64),
    Int(Box<BigInt>),
    F64(f64),
    Bytes(Box<Vec<u8>>),
    String(Box<String>),
    List(Box<Vec<Value>>),
    Tuple(Box<Vec<Value>>),
    Set(Box<Vec<Value>>),
    FrozenSet(Box<Vec<Value>>),
    Dict(Box<Vec<(Value, Value)>>),
    /// oomprobe's patch: an item taken by `DeOptions::take_list_items`.
    Taken,
}

/// Options for deserializing.
#[derive(Clone, Debug, Default)]
pub struct DeOptions {
    decode_strings: bool,
    keep_restore_state: bool,
    replace_unresolved_globals: bool,
    replace_recursive_structures: bool,
    take_list_items: Option<TakeListItem>,
}

impl DeOptions {
    /// Construct with default options:
    ///
    /// - don't decode strings saved as STRING opcodes (only protocols 0-2) as UTF-8
    /// - don't keep restore state for unpickling class instances
    /// - don't replace unresolvable globals by `None`, but error out
    /// - don't replace recursive structures by `None`, but error out
    pub fn new() -> Self {
        Default::default()
    }

    /// Activate decoding strings saved as STRING.
    pub fn decode_strings(mut self) -> Self {
        self.decode_strings = true;
        self
    }

    /// Activate keeping "restore state" for unpickling class instances, instead
    /// of replacing it by an empty dict.
    pub fn keep_restore_state(mut self) -> Self {
        self.keep_restore_state = true;
        self
    }

    /// Activate replacing unresolved globals by `None`, instead of erroring out.
    pub fn replace_unresolved_globals(mut self) -> Self {
        self.replace_unresolved_globals = true;
        self
    }

    /// Activate replacing recursive structures by `None`, instead of erroring out.
    pub fn replace_recursive_structures(mut self) -> Self {
        self.replace_recursive_structures = true;
        self
    }

    /// oomprobe's patch: offer each item appended to a memoized list to `take` while parsing
    /// ([`TakeListItem`]).
    pub fn take_list_items(mut self, take: TakeListItem) -> Self {
        self.take_list_items = Some(take);
        self
    }
}

/// Decodes pickle streams into values.
pub struct Deserializer<R: Read> {
    rdr: BufReader<R>,
    options: DeOptions,
    pos: usize,
    value: Option<Value>,                 // next value to deserialize
    memo: Memo, // pickle memo (value, number of refs)
    stack: Vec<Value>,                    // topmost items on the stack
    stacks: Vec<Vec<Value>>,              // items further down the stack, between MARKs
    // oomprobe's patch: memo entries removed by `offer_list_items` (MEMOIZE numbers entries
    // by how many were memoized).
    memo_taken: usize,
}

impl<R: Read> Deserializer<R> {
    /// Construct a new Deserializer.
    pub fn new(rdr: R, options: DeOptions) -> Deserializer<R> {
        Deserializer {
            rdr: BufReader::new(rdr),
            pos: 0,
            value: None,
            memo: Memo::default(),
            stack: Vec::with_capacity(128),
            stacks: Vec::with_capacity(16),
            memo_taken: 0,
            options,
        }
    }

    /// Reset internal state, allowing reading multiple pickle dump calls from
    /// a single stream.
    ///
    /// By default `(value_)from_reader` closes the input stream. It is possible
    /// to deserialize multiple pickle objects from a single stream by
    /// implementing a custom reader and resetting the internal state before
    /// reading the next value.
    ///
    /// # Example
    ///
    /// Using `reset_memo` inside a custom deserializer to deserialize multiple
    /// objects from a single stream.
    ///
    /// ```
    /// # use std::io::Read;
    /// # use serde_pickle::{Deserializer, Result, DeOptions};
    /// # use serde::Deserialize;
    /// struct PickleReader<R: Read + Sized>
    /// {
    ///     de: Deserializer<R>,
    /// }
    ///
    /// impl<R: Read + Sized> PickleReader<R>
    /// {
    ///    fn new(reader: R) -> PickleReader<R> {
    ///        PickleReader {
    ///            de: Deserializer::new(reader, DeOptions::new()),
    ///        }
    ///    }
    ///
    ///    pub fn read_object<'de, T: Deserialize<'de>>(&mut self) -> Result<T> {
    ///        self.de.reset_memo();
    ///        let value = Deserialize::deserialize(&mut self.de)?;
    ///        Ok(value)
    ///    }
    /// }
    ///
    /// let input = vec![0x80, 0x04, 0x95, 0x09, 0x00, 0x00, 0x00, 0x00,
    ///                  0x00, 0x00, 0x00, 0x8c, 0x05, 0x48, 0x65, 0x6c,
    ///                  0x6c, 0x6f, 0x94, 0x2e, 0x80, 0x04, 0x95, 0x0a,
    ///                  0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x8c,
    ///                  0x06, 0x70, 0x69, 0x63, 0x6b, 0x6c, 0x65, 0x94,
    ///                  0x2e, 0x00];
    /// let mut reader = PickleReader::new(std::io::Cursor::new(input.as_slice()));
    /// let string1: String = reader.read_object().unwrap();
    /// let string2: String = reader.read_object().unwrap();
    /// assert_eq!(&string1, "Hello");
    /// assert_eq!(&string2, "pickle");
    /// ```
    pub fn reset_memo(&mut self) {
        self.memo.clear();
        self.memo_taken = 0;
    }

    /// Decode a Value from this pickle.  This is different from going through
    /// the generic serde `deserialize`, since it preserves some types that are
    /// not in the serde data model, such as big integers.
    pub fn deserialize_value(&mut self) -> Result<value::Value> {
        let internal_value = self.parse_value()?;
        self.convert_value(internal_value)
    }

    /// Get the next value to deserialize, either by parsing the pickle stream
    /// or from `self.value`.
    fn get_next_value(&mut self) -> Result<Value> {
        match self.value.take() {
            Some(v) => Ok(v),
            None => self.parse_value(),
        }
    }

    /// Parse a value from the underlying stream.  This will consume the whole
    /// pickle until the STOP opcode.
    fn parse_value(&mut self) -> Result<Value> {
        loop {
            match self.read_byte()? {
                // Specials
                PROTO => {
                    // Ignore this, as it is only important for instances (read
                    // the version byte).
                    self.read_byte()?;
                }
                FRAME => {
                    // We'll ignore framing. But we still have to gobble up the length.
                    self.read_fixed_8_bytes()?;
                }
                STOP => return self.pop(),
                MARK => {
                    let stack = mem::replace(&mut self.stack, Vec::with_capacity(128));
                    self.stacks.push(stack);
                }
                POP => {
                    if self.stack.is_empty() {
                        self.pop_mark()?;
                    } else {
                        self.pop()?;
                    }
                }
                POP_MARK => {
                    self.pop_mark()?;
                }
                DUP => {
                    let top = self.top()?.clone();
                    self.stack.push(top);
                }

                // Memo saving ops
                PUT => {
                    let bytes = self.read_line()?;
                    let memo_id = self.parse_ascii(bytes)?;
                    self.memoize(memo_id)?;
                }
                BINPUT => {
                    let memo_id = self.read_byte()?;
                    self.memoize(memo_id.into())?;
                }
                LONG_BINPUT => {
                    let bytes = self.read_fixed_4_bytes()?;
                    let memo_id = LittleEndian::read_u32(&bytes);
                    self.memoize(memo_id)?;
                }
                MEMOIZE => {
                    let memo_id = self.memo.len() + self.memo_taken;
                    self.memoize(memo_id as MemoId)?;
                }

                // Memo getting ops
                GET => {
                    let bytes = self.read_line()?;
                    let memo_id = self.parse_ascii(bytes)?;
                    self.push_memo_ref(memo_id)?;
                }
                BINGET => {
                    let memo_id = self.read_byte()?;
                    self.push_memo_ref(memo_id.into())?;
                }
                LONG_BINGET => {
                    let bytes = self.read_fixed_4_bytes()?;
                    let memo_id = LittleEndian::read_u32(&bytes);
                    self.push_memo_ref(memo_id)?;
                }

                // Singletons
                NONE => self.stack.push(Value::None),
                NEWFALSE => self.stack.push(Value::Bool(false)),
                NEWTRUE => self.stack.push(Value::Bool(true)),

                // ASCII-formatted numbers
                INT => {
                    let line = self.read_line()?;
                    let val = self.decode_text_int(line)?;
                    self.stack.push(val);
                }
                LONG => {
                    let line = self.read_line()?;
                    let long = self.decode_text_long(line)?;
                    self.stack.push(long);
                }
                FLOAT => {
                    let line = self.read_line()?;
                    let f = self.parse_ascii(line)?;
                    self.stack.push(Value::F64(f));
                }

                // ASCII-formatted strings
                STRING => {
                    let line = self.read_line()?;
                    let string = self.decode_escaped_string(&line)?;
                    self.stack.push(string);
                }
                UNICODE => {
                    let line = self.read_line()?;
                    let string = self.decode_escaped_unicode(&line)?;
                    self.stack.push(string);
                }

                // Binary-coded numbers
                BINFLOAT => {
                    let bytes = self.read_fixed_8_bytes()?;
                    self.stack.push(Value::F64(BigEndian::read_f64(&bytes)));
                }
                BININT => {
                    let bytes = self.read_fixed_4_bytes()?;
                    self.stack.push(Value::I64(LittleEndian::read_i32(&bytes).into()));
                }
                BININT1 => {
                    let byte = self.read_byte()?;
                    self.stack.push(Value::I64(byte.into()));
                }
                BININT2 => {
                    let bytes = self.read_fixed_2_bytes()?;
                    self.stack.push(Value::I64(LittleEndian::read_u16(&bytes).into()));
                }
                LONG1 => {
                    let bytes = self.read_u8_prefixed_bytes()?;
                    let long = self.decode_binary_long(bytes);
                    self.stack.push(long);
                }
                LONG4 => {
                    let bytes = self.read_i32_prefixed_bytes()?;
                    let long = self.decode_binary_long(bytes);
                    self.stack.push(long);
                }

                // Length-prefixed (byte)strings
                SHORT_BINBYTES => {
                    let string = self.read_u8_prefixed_bytes()?;
                    self.stack.push(Value::Bytes(Box::new(string)));
                }
                BINBYTES => {
                    let string = self.read_u32_prefixed_bytes()?;
                    self.stack.push(Value::Bytes(Box::new(string)));
                }
                BINBYTES8 => {
                    let string = self.read_u64_prefixed_bytes()?;
                    self.stack.push(Value::Bytes(Box::new(string)));
                }
                SHORT_BINSTRING => {
                    let string = self.read_u8_prefixed_bytes()?;
                    let decoded = self.decode_string(string)?;
                    self.stack.push(decoded);
                }
                BINSTRING => {
                    let string = self.read_i32_prefixed_bytes()?;
                    let decoded = self.decode_string(string)?;
                    self.stack.push(decoded);
                }
                SHORT_BINUNICODE => {
                    let string = self.read_u8_prefixed_bytes()?;
                    let decoded = self.decode_unicode(string)?;
                    self.stack.push(decoded);
                }
                BINUNICODE => {
                    let string = self.read_u32_prefixed_bytes()?;
                    let decoded = self.decode_unicode(string)?;
                    self.stack.push(decoded);
                }
                BINUNICODE8 => {
                    let string = self.read_u64_prefixed_bytes()?;
                    let decoded = self.decode_unicode(string)?;
                    self.stack.push(decoded);
                }
                BYTEARRAY8 => {
                    let string = self.read_u64_prefixed_bytes()?;
                    self.stack.push(Value::Bytes(Box::new(string)));
                }

                // Tuples
                EMPTY_TUPLE => self.stack.push(Value::Tuple(Box::new(Vec::new()))),
                TUPLE1 => {
                    let item = self.pop()?;
                    self.stack.push(Value::Tuple(Box::new(vec![item])));
                }
                TUPLE2 => {
                    let item2 = self.pop()?;
                    let item1 = self.pop()?;
                    self.stack.push(Value::Tuple(Box::new(vec![item1, item2])));
                }
                TUPLE3 => {
                    let item3 = self.pop()?;
                    let item2 = self.pop()?;
                    let item1 = self.pop()?;
                    self.stack.push(Value::Tuple(Box::new(vec![item1, item2, item3])));
                }
                TUPLE => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(Box::new(items)));
                }

                // Lists
                EMPTY_LIST => self.stack.push(Value::List(Box::new(Vec::new()))),
                LIST => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::List(Box::new(items)));
                }
                APPEND => {
                    let mut value = vec![self.pop()?];
                    self.offer_list_items(&mut value)?;
                    self.modify_list(|list| list.extend(value))?;
                }
                APPENDS => {
                    let mut items = self.pop_mark()?;
                    self.offer_list_items(&mut items)?;
                    self.modify_list(|list| list.extend(items))?;
                }

                // Dicts
                EMPTY_DICT => self.stack.push(Value::Dict(Box::new(Vec::new()))),
                DICT => {
                    let items = self.pop_mark()?;
                    let mut dict = Vec::with_capacity(items.len() / 2);
                    Self::extend_dict(&mut dict, items);
                    self.stack.push(Value::Dict(Box::new(dict)));
                }
                SETITEM => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.modify_dict(|dict| dict.push((key, value)))?;
                }
                SETITEMS => {
                    let items = self.pop_mark()?;
                    self.modify_dict(|dict| Self::extend_dict(dict, items))?;
                }

                // Sets and frozensets
                EMPTY_SET => self.stack.push(Value::Set(Box::new(Vec::new()))),
                FROZENSET => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::FrozenSet(Box::new(items)));
                }
                ADDITEMS => {
                    let items = self.pop_mark()?;
                    self.modify_set(|set| set.extend(items))?;
                }

                // Arbitrary module globals, used here for unpickling set and frozenset
                // from protocols < 4
                GLOBAL => {
                    let modname = self.read_line()?;
                    let globname = self.read_line()?;
                    let value = self.decode_global(modname, globname)?;
                    self.stack.push(value);
                }
                STACK_GLOBAL => {
                    let globname = match self.pop_resolve()? {
                        Value::String(string) => string.into_bytes(),
                        other => return Self::stack_error("string", &other, self.pos),
                    };
                    let modname = match self.pop_resolve()? {
                        Value::String(string) => string.into_bytes(),
                        other => return Self::stack_error("string", &other, self.pos),
                    };
                    let value = self.decode_global(modname, globname)?;
                    self.stack.push(value);
                }
                REDUCE => {
                    let argtuple = match self.pop_resolve()? {
                        Value::Tuple(args) => args,
                        other => return Self::stack_error("tuple", &other, self.pos),
                    };
                    let global = self.pop_resolve()?;
                    self.reduce_global(global, *argtuple)?;
                }

                // Arbitrary classes - make a best effort attempt to recover some data
                INST => {
                    // pop module name and class name
                    for _ in 0..2 {
                        self.read_line()?;
                    }
                    // pop arguments to init
                    let args = self.pop_mark()?;
                    if self.options.keep_restore_state {
                        self.stack.push(Value::Tuple(Box::new(args)));
                    } else {
                        self.stack.push(Value::Dict(Box::new(Vec::new())));
                    }
                }
                OBJ => {
                    // pop arguments to init
                    let args = self.pop_mark()?;
                    // pop class object
                    self.pop()?;
                    if self.options.keep_restore_state {
                        self.stack.push(Value::Tuple(Box::new(args)));
                    } else {
                        self.stack.push(Value::Dict(Box::new(Vec::new())));
                    }
                }
                NEWOBJ => {
                    // pop arguments and class object
                    let args = self.pop()?;
                    self.pop()?;
                    if self.options.keep_restore_state {
                        self.stack.push(args);
                    } else {
                        self.stack.push(Value::Dict(Box::new(Vec::new())));
                    }
                }
                NEWOBJ_EX => {
                    // pop keyword args, arguments and class object
                    let kwargs = self.pop()?;
                    let args = self.pop()?;
                    self.pop()?;
                    if self.options.keep_restore_state {
                        self.stack.push(Value::Tuple(Box::new(vec![args, kwargs])));
                    } else {
                        self.stack.push(Value::Dict(Box::new(Vec::new())));
                    }
                }
                BUILD => {
                    // The top-of-stack for BUILD is used either as the instance __dict__,
                    // or an argument for __setstate__, in which case it can be *any* type
                    // of object.  In both cases, we just replace the standin.
                    let state = self.pop()?;
                    self.pop()?; // remove the object standin
                    self.stack.push(state);
                }

                // Unsupported opcodes
                code => return self.error(ErrorCode::Unsupported(code as char)),
            }
        }
    }

    // Pop the stack top item.
    fn pop(&mut self) -> Result<Value> {
        match self.stack.pop() {
            Some(v) => Ok(v),
            None => self.error(ErrorCode::StackUnderflow),
        }
    }

    // Pop the stack top item, and resolve it if it is a memo reference.
    fn pop_resolve(&mut self) -> Result<Value> {
        let top = self.stack.pop();
        match top {
            Some(v) => self.resolve(v),
            None => self.error(ErrorCode::StackUnderflow),
        }
    }

    // Pop all topmost stack items until the next MARK.
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        match self.stacks.pop() {
            Some(new) => Ok(mem::replace(&mut self.stack, new)),
            None => self.error(ErrorCode::StackUnderflow),
        }
    }

    // Mutably view the stack top item.
    fn top(&mut self) -> Result<&mut Value> {
        match self.stack.last_mut() {
            // Since some operations like APPEND do things to the stack top, we
            // need to provide the reference to the "real" object here, not the
            // MemoRef variant.
            Some(&mut Value::MemoRef(n)) => self
                .memo
                .get_mut(&n)
                .map(|e| e.value.get_mut())
                .ok_or(Error::Syntax(ErrorCode::MissingMemo(n))),
            Some(other_value) => Ok(other_value),
            None => Err(Error::Eval(ErrorCode::StackUnderflow, self.pos)),
        }
    }

    // Pushes a memo reference on the stack, and increases the usage counter.
    fn push_memo_ref(&mut self, memo_id: MemoId) -> Result<()> {
        self.stack.push(Value::MemoRef(memo_id));
        match self.memo.get_mut(&memo_id) {
            Some(e) => {
                e.refs.set(e.refs.get() + 1);
                Ok(())
            }
            None => Err(Error::Eval(ErrorCode::MissingMemo(memo_id), self.pos)),
        }
    }

    // Memoize the current stack top with the given ID.  Moves the actual
    // object into the memo, and saves a reference on the stack instead.
    fn memoize(&mut self, memo_id: MemoId) -> Result<()> {
        let mut item = self.pop()?;
        if let Value::MemoRef(id) = item {
            // TODO: is this even possible?
            item = match self.memo.get(&id) {
                Some(e) => e.value.borrow().clone(),
                None => return Err(Error::Eval(ErrorCode::MissingMemo(id), self.pos)),
            };
        }
        self.memo.insert(memo_id, MemoEntry { value: RefCell::new(item), refs: Cell::new(1) });
        self.stack.push(Value::MemoRef(memo_id));
        Ok(())
    }

    // Resolve memo reference during stream decoding.
    fn resolve(&mut self, memo: Value) -> Result<Value> {
        match memo {
            Value::MemoRef(id) => match self.memo.get_mut(&id) {
                None => Err(Error::Eval(ErrorCode::MissingMemo(id), self.pos)),
                Some(e) => {
                    // We can't remove it from the memo here, since we haven't
                    // decoded the whole stream yet and there may be further
                    // references to the value.
                    e.refs.set(e.refs.get() - 1);
                    Ok(e.value.get_mut().clone())
                }
            },
            other => Ok(other),
        }
    }

    // Resolve memo reference during Value deserializing.
    fn resolve_recursive<T, U, F>(&mut self, id: MemoId, u: U, f: F) -> Result<T>
    where
        F: FnOnce(&mut Self, U, Value) -> Result<T>,
    {
        // Take the value from the memo while visiting it.  This prevents us
        // from trying to depickle recursive structures, which we can't do
        // because our Values aren't references.
        let (value, mut count) = match self.memo.remove(&id) {
            Some(e) => (e.value.into_inner(), e.refs.get()),
            None => {
                return {
                    if self.options.replace_recursive_structures {
                        f(self, u, Value::None)
                    } else {
                        Err(Error::Syntax(ErrorCode::Recursive))
                    }
                }
            }
        };
        // oomprobe's patch: always put the value back. The reference count only counts the
        // GET opcodes of the stream, not the references a shared container carries inside it
        // (a memoized list of memoized dicts used many times, as PyTorch's memory snapshots
        // share their stack frames), so dropping the value at zero broke later references
        // with "recursive structure found" (upstream PR #24 and issue #25).
        count -= 1;
        let result = f(self, u, value.clone());
        self.memo.insert(id, MemoEntry { value: RefCell::new(value), refs: Cell::new(count) });
        result
    }

    /// Assert that we reached the end of the stream.
    pub fn end(&mut self) -> Result<()> {
        let mut buf = [0];
        match self.rdr.read(&mut buf) {
            Err(err) => Err(Error::Io(err)),
            Ok(1) => self.error(ErrorCode::TrailingBytes),
            _ => Ok(()),
        }
    }

    fn read_line(&mut self) -> Result<Vec<u8>> {
        let mut buf = Vec::with_capacity(16);
        match self.rdr.read_until(b'\n', &mut buf) {
            Ok(_) => {
                self.pos += buf.len();
                buf.pop(); // remove newline
                if buf.last() == Some(&b'\r') {
                    buf.pop();
                }
                Ok(buf)
            }
            Err(err) => Err(Error::Io(err)),
        }
    }

    #[inline]
    fn read_byte(&mut self) -> Result<u8> {
        let mut buf = [0];
        match self.rdr.read(&mut buf) {
            Ok(1) => {
                self.pos += 1;
                Ok(buf[0])
            }
            Ok(_) => self.error(ErrorCode::EOFWhileParsing),
            Err(err) => Err(Error::Io(err)),
        }
    }

    #[inline]
    fn read_bytes(&mut self, n: usize) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        match self.rdr.by_ref().take(n as u64).read_to_end(&mut buf) {
            Ok(m) if n == m => {
                self.pos += n;
                Ok(buf)
            }
            Ok(_) => self.error(ErrorCode::EOFWhileParsing),
            Err(err) => Err(Error::Io(err)),
        }
    }

    #[inline]
    fn read_fixed_2_bytes(&mut self) -> Result<[u8; 2]> {
        let mut buf = [0; 2];
        match self.rdr.by_ref().take(2).read_exact(&mut buf) {
            Ok(()) => {
                self.pos += 2;
                Ok(buf)
            }
            Err(err) => {
                if err.kind() == std::io::ErrorKind::UnexpectedEof {
                    self.error(ErrorCode::EOFWhileParsing)
                } else {
                    Err(Error::Io(err))
                }
            }
        }
    }

    #[inline]
    fn read_fixed_4_bytes(&mut self) -> Result<[u8; 4]> {
        let mut buf = [0; 4];
        match self.rdr.by_ref().take(4).read_exact(&mut buf) {
            Ok(()) => {
                self.pos += 4;
                Ok(buf)
            }
            Err(err) => {
                if err.kind() == std::io::ErrorKind::UnexpectedEof {
                    self.error(ErrorCode::EOFWhileParsing)
                } else {
                    Err(Error::Io(err))
                }
            }
        }
    }

    #[inline]
    fn read_fixed_8_bytes(&mut self) -> Result<[u8; 8]> {
        let mut buf = [0; 8];
        match self.rdr.by_ref().take(8).read_exact(&mut buf) {
            Ok(()) => {
                self.pos += 8;
                Ok(buf)
            }
            Err(err) => {
                if err.kind() == std::io::ErrorKind::UnexpectedEof {
                    self.error(ErrorCode::EOFWhileParsing)
                } else {
                    Err(Error::Io(err))
                }
            }
        }
    }

    fn read_i32_prefixed_bytes(&mut self) -> Result<Vec<u8>> {
        let lenbytes = self.read_fixed_4_bytes()?;
        match LittleEndian::read_i32(&lenbytes) {
            0 => Ok(vec![]),
            l if l < 0 => self.error(ErrorCode::NegativeLength),
            l => self.read_bytes(l as usize),
        }
    }

    fn read_u64_prefixed_bytes(&mut self) -> Result<Vec<u8>> {
        let lenbytes = self.read_fixed_8_bytes()?;
        self.read_bytes(LittleEndian::read_u64(&lenbytes) as usize)
    }

    fn read_u32_prefixed_bytes(&mut self) -> Result<Vec<u8>> {
        let lenbytes = self.read_fixed_4_bytes()?;
        self.read_bytes(LittleEndian::read_u32(&lenbytes) as usize)
    }

    fn read_u8_prefixed_bytes(&mut self) -> Result<Vec<u8>> {
        let lenbyte = self.read_byte()?;
        self.read_bytes(lenbyte as usize)
    }

    // Parse an expected ASCII literal from the stream or raise an error.
    fn parse_ascii<T: FromStr>(&self, bytes: Vec<u8>) -> Result<T> {
        match str::from_utf8(&bytes).unwrap_or("").parse() {
            Ok(v) => Ok(v),
            Err(_) => self.error(ErrorCode::InvalidLiteral(bytes)),
        }
    }

    // Decode a text-encoded integer.
    fn decode_text_int(&self, line: Vec<u8>) -> Result<Value> {
        // Handle protocol 1 way of spelling true/false
        Ok(if line == b"00" {
            Value::Bool(false)
        } else if line == b"01" {
            Value::Bool(true)
        } else {
            let i = self.parse_ascii(line)?;
            Value::I64(i)
        })
    }

    // Decode a text-encoded long integer.
    fn decode_text_long(&self, mut line: Vec<u8>) -> Result<Value> {
        // Remove "L" suffix.
        if line.last() == Some(&b'L') {
            line.pop();
        }
        match BigInt::parse_bytes(&line, 10) {
            Some(i) => Ok(Value::Int(Box::new(i))),
            None => self.error(ErrorCode::InvalidLiteral(line)),
        }
    }

    // Decode an escaped string.  These are encoded with "normal" Python string
    // escape rules.
    fn decode_escaped_string(&self, slice: &[u8]) -> Result<Value> {
        // Remove quotes if they appear.
        let slice = if (slice.len() >= 2)
            && (slice[0] == slice[slice.len() - 1])
            && (slice[0] == b'"' || slice[0] == b'\'')
        {
            &slice[1..slice.len() - 1]
        } else {
            slice
        };
        let mut result = Vec::with_capacity(slice.len());
        let mut iter = slice.iter();
        while let Some(&b) = iter.next() {
            match b {
                b'\\' => match iter.next() {
                    Some(&b'\\') => result.push(b'\\'),
                    Some(&b'a') => result.push(b'\x07'),
                    Some(&b'b') => result.push(b'\x08'),
                    Some(&b't') => result.push(b'\x09'),
                    Some(&b'n') => result.push(b'\x0a'),
                    Some(&b'v') => result.push(b'\x0b'),
                    Some(&b'f') => result.push(b'\x0c'),
                    Some(&b'r') => result.push(b'\x0d'),
                    Some(&b'x') => {
                        match iter.next().and_then(|&ch1| (ch1 as char).to_digit(16)).and_then(|v1| {
                            iter.next()
                                .and_then(|&ch2| (ch2 as char).to_digit(16))
                                .map(|v2| 16 * (v1 as u8) + (v2 as u8))
                        }) {
                            Some(v) => result.push(v),
                            None => return self.error(ErrorCode::InvalidLiteral(slice.into())),
                        }
                    }
                    _ => return self.error(ErrorCode::InvalidLiteral(slice.into())),
                },
                _ => result.push(b),
            }
        }
        self.decode_string(result)
    }

    // Decode escaped Unicode strings. These are encoded with "raw-unicode-escape",
    // which only knows the \uXXXX and \UYYYYYYYY escapes. The backslash is escaped
    // in this way, too.
    fn decode_escaped_unicode(&self, s: &[u8]) -> Result<Value> {
        let mut result = String::with_capacity(s.len());
        let mut iter = s.iter();
        while let Some(&b) = iter.next() {
            match b {
                b'\\' => {
                    let nescape = match iter.next() {
                        Some(&b'u') => 4,
                        Some(&b'U') => 8,
                        _ => return self.error(ErrorCode::InvalidLiteral(s.into())),
                    };
                    let mut accum = 0;
                    for _i in 0..nescape {
                        accum *= 16;
                        match iter.next().and_then(|&ch| (ch as char).to_digit(16)) {
                            Some(v) => accum += v,
                            None => return self.error(ErrorCode::InvalidLiteral(s.into())),
                        }
                    }
                    match char::from_u32(accum) {
                        Some(v) => result.push(v),
                        None => return self.error(ErrorCode::InvalidLiteral(s.into())),
                    }
                }
                _ => result.push(b as char),
            }
        }
        Ok(Value::String(Box::new(result)))
    }

    // Decode a string - either as Unicode or as bytes.
    fn decode_string(&self, string: Vec<u8>) -> Result<Value> {
        if self.options.decode_strings {
            self.decode_unicode(string)
        } else {
            Ok(Value::Bytes(Box::new(string)))
        }
    }

    // Decode a Unicode string from UTF-8.
    fn decode_unicode(&self, string: Vec<u8>) -> Result<Value> {
        match String::from_utf8(string) {
            Ok(v) => Ok(Value::String(Box::new(v))),
            Err(_) => self.error(ErrorCode::StringNotUTF8),
        }
    }

    // Decode a binary-encoded long integer.
    fn decode_binary_long(&self, bytes: Vec<u8>) -> Value {
        // oomprobe's patch: a long of at most 8 bytes (pickle writes every int above 2^31 as
        // one: addresses, sizes, timestamps) is an i64, without a BigInt's two allocations.
        if !bytes.is_empty() && bytes.len() <= 8 {
            let fill = if bytes[bytes.len() - 1] & 0x80 != 0 { 0xff } else { 0 };
            let mut le = [fill; 8];
            le[..bytes.len()].copy_from_slice(&bytes);
            return Value::I64(i64::from_le_bytes(le));
        }
        // BigInt::from_bytes_le doesn't like a sign bit in the bytes, therefore
        // we have to extract that ourselves and do the two-s complement.
        let negative = !bytes.is_empty() && (bytes[bytes.len() - 1] & 0x80 != 0);
        let mut val = BigInt::from_bytes_le(Sign::Plus, &bytes);
        if negative {
            val -= BigInt::from(1) << (bytes.len() * 8);
        }
        Value::Int(Box::new(val))
    }

    // Modify the stack-top list.
    // oomprobe's patch: offer items about to be appended to the memoized list on the stack top
    // to `DeOptions::take_list_items`; a taken item becomes `Value::Taken` and leaves the memo.
    fn offer_list_items(&mut self, items: &mut [Value]) -> Result<()> {
        let Some(take) = self.options.take_list_items else {
            return Ok(());
        };
        let Some(&Value::MemoRef(list)) = self.stack.last() else {
            return Ok(());
        };
        let visiting = RefCell::new(Vec::new());
        let read_by_id = RefCell::new(Vec::new());
        for item in items.iter_mut() {
            let walk = Walk {
                value: item,
                memo: &self.memo,
                visiting: &visiting,
                options: &self.options,
                once: false,
                read_by_id: Some(&read_by_id),
            };
            let taken = take(u64::from(list), walk)?;
            let read = mem::take(&mut *read_by_id.borrow_mut());
            if !taken {
                continue;
            }
            for id in read {
                if let Some(e) = self.memo.get_mut(&id) {
                    *e.value.get_mut() = Value::None;
                }
            }
            if let Value::MemoRef(id) = mem::replace(item, Value::Taken) {
                if self.memo.remove(&id).is_some() {
                    self.memo_taken += 1;
                }
            }
        }
        Ok(())
    }

    fn modify_list<F>(&mut self, f: F) -> Result<()>
    where
        F: FnOnce(&mut Vec<Value>),
    {
        let pos = self.pos;
        let top = self.top()?;
        if let Value::List(ref mut list) = *top {
            f(list);
            Ok(())
        } else {
            Self::stack_error("list", top, pos)
        }
    }

    // Push items from a (key, value, key, value) flattened list onto a (key, value) vec.
    fn extend_dict(dict: &mut Vec<(Value, Value)>, items: Vec<Value>) {
        // oomprobe's patch: room for exactly these pairs (a million small dicts, each grown
        // by doubling, held a third more than they needed).
        dict.reserve_exact(items.len() / 2);
        let mut key = None;
        for value in items {
            match key.take() {
                None => key = Some(value),
                Some(key) => dict.push((key, value)),
            }
        }
    }

    // Modify the stack-top dict.
    fn modify_dict<F>(&mut self, f: F) -> Result<()>
    where
        F: FnOnce(&mut Vec<(Value, Value)>),
    {
        let pos = self.pos;
        let top = self.top()?;
        if let Value::Dict(ref mut dict) = *top {
            f(dict);
            Ok(())
        } else {
            Self::stack_error("dict", top, pos)
        }
    }

    // Modify the stack-top set.
    fn modify_set<F>(&mut self, f: F) -> Result<()>
    where
        F: FnOnce(&mut Vec<Value>),
    {
        let pos = self.pos;
        let top = self.top()?;
        if let Value::Set(ref mut set) = *top {
            f(set);
            Ok(())
        } else {
            Self::stack_error("set", top, pos)
        }
    }

    // Push the Value::Global referenced by modname and globname.
    fn decode_global(&mut self, modname: Vec<u8>, globname: Vec<u8>) -> Result<Value> {
        let value = match (&*modname, &*globname) {
            (b"_codecs", b"encode") => Value::Global(Global::Encode),
            (b"copy_reg", b"_reconstructor") | (b"copyreg", b"_reconstructor") => {
                Value::Global(Global::Reconst)
            }
            (b"__builtin__", b"set") | (b"builtins", b"set") => Value::Global(Global::Set),
            (b"__builtin__", b"frozenset") | (b"builtins", b"frozenset") => Value::Global(Global::Frozenset),
            (b"__builtin__", b"list") | (b"builtins", b"list") => Value::Global(Global::List),
            (b"__builtin__", b"bytearray") | (b"builtins", b"bytearray") => Value::Global(Global::Bytearray),
            (b"__builtin__", b"int") | (b"builtins", b"int") => Value::Global(Global::Int),
            _ => Value::Global(Global::Other),
        };
        Ok(value)
    }

    // Handle the REDUCE opcode for the few Global objects we support.
    fn reduce_global(&mut self, global: Value, mut argtuple: Vec<Value>) -> Result<()> {
        match global {
            Value::Global(Global::Set) => match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                Some(Value::List(items)) => {
                    self.stack.push(Value::Set(items));
                    Ok(())
                }
                _ => self.error(ErrorCode::InvalidValue("set() arg".into())),
            },
            Value::Global(Global::Frozenset) => match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                Some(Value::List(items)) => {
                    self.stack.push(Value::FrozenSet(items));
                    Ok(())
                }
                _ => self.error(ErrorCode::InvalidValue("frozenset() arg".into())),
            },
            Value::Global(Global::Bytearray) => {
                // On Py2, the call is encoded as bytearray(u"foo", "latin-1").
                argtuple.truncate(1);
                match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                    Some(Value::Bytes(bytes)) => {
                        self.stack.push(Value::Bytes(bytes));
                        Ok(())
                    }
                    Some(Value::String(string)) => {
                        // The code points in the string are actually bytes values.
                        // So we need to collect them individually.
                        self.stack
                            .push(Value::Bytes(Box::new(string.chars().map(|ch| ch as u32 as u8).collect())));
                        Ok(())
                    }
                    _ => self.error(ErrorCode::InvalidValue("bytearray() arg".into())),
                }
            }
            Value::Global(Global::List) => match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                Some(Value::List(items)) => {
                    self.stack.push(Value::List(items));
                    Ok(())
                }
                _ => self.error(ErrorCode::InvalidValue("list() arg".into())),
            },
            Value::Global(Global::Int) => match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                Some(Value::Int(integer)) => {
                    self.stack.push(Value::Int(integer));
                    Ok(())
                }
                _ => self.error(ErrorCode::InvalidValue("int() arg".into())),
            },
            Value::Global(Global::Encode) => {
                // Byte object encoded as _codecs.encode(x, 'latin1')
                match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                    // Encoding, always latin1
                    Some(Value::String(_)) => {}
                    _ => return self.error(ErrorCode::InvalidValue("encode() arg".into())),
                }
                match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                    Some(Value::String(s)) => {
                        // Now we have to convert the string to latin-1
                        // encoded bytes.  It never contains codepoints
                        // above 0xff.
                        let bytes: Vec<u8> = s.chars().map(|ch| ch as u8).collect();
                        self.stack.push(Value::Bytes(Box::new(bytes)));
                        Ok(())
                    }
                    _ => self.error(ErrorCode::InvalidValue("encode() arg".into())),
                }
            }
            Value::Global(Global::Reconst) => {
                // Arguments are (class, base, state), we keep state if enabled,
                // else push an empty dict (for compatibility with NEWOBJ below).
                if self.options.keep_restore_state {
                    let state = match argtuple.pop().map(|v| self.resolve(v)).transpose()? {
                        Some(obj) => obj,
                        None => Value::Dict(Box::new(Vec::new())),
                    };
                    self.stack.push(state);
                } else {
                    self.stack.push(Value::Dict(Box::new(Vec::new())));
                }
                Ok(())
            }
            Value::Global(Global::Other) => {
                // Anything else; just keep it on the stack as an opaque object.
                // If it is a class object, it will get replaced later when the
                // class is instantiated.
                if self.options.keep_restore_state {
                    let result: Result<_> = argtuple.into_iter().map(|v| self.resolve(v)).collect();
                    self.stack.push(Value::Tuple(Box::new(result?)));
                } else {
                    self.stack.push(Value::Global(Global::Other));
                }
                Ok(())
            }
            other => Self::stack_error("global reference", &other, self.pos),
        }
    }

    fn stack_error<T>(what: &'static str, value: &Value, pos: usize) -> Result<T> {
        let it = format!("{:?}", value);
        Err(Error::Eval(ErrorCode::InvalidStackTop(what, it), pos))
    }

    fn error<T>(&self, reason: ErrorCode) -> Result<T> {
        Err(Error::Eval(reason, self.pos))
    }

    fn convert_value(&mut self, value: Value) -> Result<value::Value> {
        match value {
            Value::None | Value::Taken => Ok(value::Value::None),
            Value::Bool(v) => Ok(value::Value::Bool(v)),
            Value::I64(v) => Ok(value::Value::I64(v)),
            Value::Int(v) => {
                if let Some(i) = v.to_i64() {
                    Ok(value::Value::I64(i))
                } else {
                    Ok(value::Value::Int(*v))
                }
            }
            Value::F64(v) => Ok(value::Value::F64(v)),
            Value::Bytes(v) => Ok(value::Value::Bytes(*v)),
            Value::String(v) => Ok(value::Value::String(*v)),
            Value::List(v) => {
                let new = v.into_iter().map(|v| self.convert_value(v)).collect::<Result<_>>();
                Ok(value::Value::List(new?))
            }
            Value::Tuple(v) => {
                let new = v.into_iter().map(|v| self.convert_value(v)).collect::<Result<_>>();
                Ok(value::Value::Tuple(new?))
            }
            Value::Set(v) => {
                let new = v
                    .into_iter()
                    .map(|v| self.convert_value(v).and_then(|rv| rv.into_hashable()))
                    .collect::<Result<_>>();
                Ok(value::Value::Set(new?))
            }
            Value::FrozenSet(v) => {
                let new = v
                    .into_iter()
                    .map(|v| self.convert_value(v).and_then(|rv| rv.into_hashable()))
                    .collect::<Result<_>>();
                Ok(value::Value::FrozenSet(new?))
            }
            Value::Dict(v) => {
                let mut map = BTreeMap::new();
                for (key, value) in *v {
                    let real_key = self.convert_value(key).and_then(|rv| rv.into_hashable())?;
                    let real_value = self.convert_value(value)?;
                    map.insert(real_key, real_value);
                }
                Ok(value::Value::Dict(map))
            }
            Value::MemoRef(memo_id) => {
                self.resolve_recursive(memo_id, (), |slf, (), value| slf.convert_value(value))
            }
            Value::Global(_) => {
                if self.options.replace_unresolved_globals {
                    Ok(value::Value::None)
                } else {
                    Err(Error::Syntax(ErrorCode::UnresolvedGlobal))
                }
            }
        }
    }
}

// oomprobe's patch: the parsed value is walked by reference. A memo reference is followed into
// the memo, not resolved by deep-cloning the memoized value (upstream clones it at each use:
// PyTorch's memory snapshots share stack-frame lists, frame dicts and strings between
// thousands of trace entries, so the clones made reading a 58 MB file take gigabytes and
// minutes). Recursion is still detected: a memo entry being visited is in `visiting`.
impl<'de: 'a, 'a, R: Read> de::Deserializer<'de> for &'a mut Deserializer<R> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.walk(|w| w.deserialize_any(visitor))
    }

    #[inline]
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.walk(|w| w.deserialize_option(visitor))
    }

    #[inline]
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self, name: &'static str, visitor: V,
    ) -> Result<V::Value> {
        self.walk(|w| w.deserialize_newtype_struct(name, visitor))
    }

    #[inline]
    fn deserialize_enum<V: Visitor<'de>>(
        self, name: &'static str, variants: &'static [&'static str], visitor: V,
    ) -> Result<V::Value> {
        self.walk(|w| w.deserialize_enum(name, variants, visitor))
    }

    forward_to_deserialize_any! {
        bool u8 u16 u32 u64 i8 i16 i32 i64 f32 f64 char str string unit seq
        bytes byte_buf map tuple_struct struct identifier
        tuple ignored_any unit_struct
    }
}

impl<R: Read> Deserializer<R> {
    /// Parse the next value and walk it, by reference, with `f`.
    fn walk<T>(&mut self, f: impl FnOnce(Walk<'_>) -> Result<T>) -> Result<T> {
        let value = self.get_next_value()?;
        // Count the references: a value referenced once, from a part of the value visited
        // once, is visited once, and freed after (a million trace entries need not be held
        // while their typed copies are made).
        for e in self.memo.values() {
            e.refs.set(0);
        }
        count_refs(&value, &self.memo);
        for e in self.memo.values() {
            count_refs(&e.value.borrow(), &self.memo);
        }
        let visiting = RefCell::new(Vec::new());
        let result =
            f(Walk {
                value: &value,
                memo: &self.memo,
                visiting: &visiting,
                options: &self.options,
                once: true,
                read_by_id: None,
            });
        self.memo.retain(|_, e| e.refs.get() >= 0);
        result
    }
}

/// Count the memo references in `value` (not in the values they point to) into `memo`.
fn count_refs(value: &Value, memo: &Memo) {
    match value {
        Value::MemoRef(id) => {
            if let Some(e) = memo.get(id) {
                e.refs.set(e.refs.get().saturating_add(1));
            }
        }
        Value::List(v) | Value::Tuple(v) | Value::Set(v) | Value::FrozenSet(v) => {
            v.iter().for_each(|x| count_refs(x, memo))
        }
        Value::Dict(v) => v.iter().for_each(|(k, x)| {
            count_refs(k, memo);
            count_refs(x, memo);
        }),
        _ => {}
    }
}

/// A parsed value and the memo its references point into: the deserializer a
/// [`TakeListItem`] is given.
#[derive(Clone, Copy)]
pub struct Walk<'v> {
    value: &'v Value,
    memo: &'v Memo,
    /// The memo entries being visited (as deep as the value nests): meeting one again is a
    /// recursive structure.
    visiting: &'v RefCell<Vec<MemoId>>,
    options: &'v DeOptions,
    /// Whether this part of the value is visited once in the whole walk.
    once: bool,
    /// While an item is offered to `DeOptions::take_list_items`: the memo ids read through
    /// `MEMO_ID`.
    read_by_id: Option<&'v RefCell<Vec<MemoId>>>,
}

static NONE_VALUE: Value = Value::None;

impl<'v> Walk<'v> {
    fn at(self, value: &'v Value) -> Walk<'v> {
        Walk { value, ..self }
    }

    /// Call `f` with the value a memo reference points to (or the value itself). A value
    /// referenced once from a part visited once is taken out of the memo and freed after.
    fn resolved<T>(self, f: impl for<'w> FnOnce(Walk<'w>) -> Result<T>) -> Result<T> {
        let Value::MemoRef(id) = *self.value else {
            return f(self);
        };
        let target = if self.visiting.borrow().contains(&id) {
            Target::Recursive
        } else {
            let Some(entry) = self.memo.get(&id) else {
                return Err(Error::Syntax(ErrorCode::MissingMemo(id)));
            };
            if self.once && entry.refs.get() == 1 {
                match entry.value.try_borrow_mut() {
                    Ok(mut v) => {
                        entry.refs.set(-1);
                        Target::Owned(mem::replace(&mut *v, Value::None))
                    }
                    Err(_) => Target::Recursive,
                }
            } else {
                match entry.value.try_borrow() {
                    Ok(v) => Target::Shared(v),
                    Err(_) => Target::Recursive,
                }
            }
        };
        let (value, once): (&Value, bool) = match &target {
            Target::Recursive if self.options.replace_recursive_structures => return f(self.at(&NONE_VALUE)),
            Target::Recursive => return Err(Error::Syntax(ErrorCode::Recursive)),
            Target::Owned(v) => (v, self.once),
            Target::Shared(v) => (v, false),
        };
        self.visiting.borrow_mut().push(id);
        let result = Walk { value, once, ..self }.resolved(f);
        self.visiting.borrow_mut().pop();
        result
    }
}

/// What a memo reference leads to while walking.
enum Target<'a> {
    /// Taken out of the memo: visited for the last time.
    Owned(Value),
    Shared(std::cell::Ref<'a, Value>),
    /// Being visited already.
    Recursive,
}

impl<'de, 'v> de::Deserializer<'de> for Walk<'v> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.resolved(|w| match w.value {
            Value::None | Value::Taken => visitor.visit_unit(),
            Value::Bool(v) => visitor.visit_bool(*v),
            Value::I64(v) => visitor.visit_i64(*v),
            Value::Int(v) => {
                if let Some(i) = v.to_i64() {
                    visitor.visit_i64(i)
                } else {
                    Err(Error::Syntax(ErrorCode::InvalidValue("integer too large".into())))
                }
            }
            Value::F64(v) => visitor.visit_f64(*v),
            Value::Bytes(v) => visitor.visit_bytes(v),
            Value::String(v) => visitor.visit_str(v),
            Value::List(v) | Value::Tuple(v) | Value::Set(v) | Value::FrozenSet(v) => {
                visitor.visit_seq(SeqAccess { walk: w, iter: v.iter() })
            }
            Value::Dict(v) => visitor.visit_map(MapAccess { walk: w, iter: v.iter(), value: None }),
            // `resolved` follows references until it reaches a value.
            Value::MemoRef(id) => Err(Error::Syntax(ErrorCode::MissingMemo(*id))),
            Value::Global(_) => {
                if w.options.replace_unresolved_globals {
                    visitor.visit_unit()
                } else {
                    Err(Error::Syntax(ErrorCode::UnresolvedGlobal))
                }
            }
        })
    }

    #[inline]
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.resolved(|w| match w.value {
            Value::None => visitor.visit_none(),
            _ => visitor.visit_some(w),
        })
    }

    #[inline]
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self, name: &'static str, visitor: V,
    ) -> Result<V::Value> {
        if name != MEMO_ID {
            return visitor.visit_newtype_struct(self);
        }
        let id = match *self.value {
            Value::MemoRef(id) => Some(id),
            _ => None,
        };
        if let (Some(id), Some(read)) = (id, self.read_by_id) {
            read.borrow_mut().push(id);
        }
        visitor.visit_seq(MemoIdAccess { walk: self, id: Some(id), value: true })
    }

    #[inline]
    fn deserialize_enum<V: Visitor<'de>>(
        self, _name: &'static str, _variants: &'static [&'static str], visitor: V,
    ) -> Result<V::Value> {
        self.resolved(|w| visitor.visit_enum(VariantAccess { walk: w, args: None }))
    }

    forward_to_deserialize_any! {
        bool u8 u16 u32 u64 i8 i16 i32 i64 f32 f64 char str string unit seq
        bytes byte_buf map tuple_struct struct identifier
        tuple ignored_any unit_struct
    }
}

/// An enum as a `(name, args)` tuple, a `{name: args}` dict or a bare name.
struct VariantAccess<'v> {
    walk: Walk<'v>,
    args: Option<Walk<'v>>,
}

impl<'de, 'v> de::EnumAccess<'de> for VariantAccess<'v> {
    type Error = Error;
    type Variant = Self;

    fn variant_seed<V: de::DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self)> {
        let w = self.walk;
        let (name, args) = match w.value {
            Value::Tuple(v) if v.len() == 2 => (&v[0], Some(w.at(&v[1]))),
            Value::Tuple(v) if !v.is_empty() => (&v[v.len() - 1], None),
            Value::Dict(v) if v.len() == 1 => (&v[0].0, Some(w.at(&v[0].1))),
            Value::Dict(_) => {
                return Err(Error::Syntax(ErrorCode::Structure(
                    "enum variants must have one dict entry".into(),
                )))
            }
            s @ Value::String(_) => (s, None),
            _ => {
                return Err(Error::Syntax(ErrorCode::Structure(
                    "enums must be represented as dicts or tuples".into(),
                )))
            }
        };
        let val = seed.deserialize(w.at(name))?;
        Ok((val, VariantAccess { walk: w, args }))
    }
}

impl<'v> VariantAccess<'v> {
    fn args(self) -> Result<Walk<'v>> {
        self.args
            .ok_or_else(|| Error::Syntax(ErrorCode::Structure("enum variant without its value".into())))
    }
}

impl<'de, 'v> de::VariantAccess<'de> for VariantAccess<'v> {
    type Error = Error;

    fn unit_variant(self) -> Result<()> {
        Ok(())
    }

    fn newtype_variant_seed<T: de::DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
        seed.deserialize(self.args()?)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value> {
        de::Deserializer::deserialize_any(self.args()?, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self, _fields: &'static [&'static str], visitor: V,
    ) -> Result<V::Value> {
        de::Deserializer::deserialize_any(self.args()?, visitor)
    }
}

/// The two elements of a [`MEMO_ID`] newtype: the memo id, then the value.
struct MemoIdAccess<'v> {
    walk: Walk<'v>,
    id: Option<Option<MemoId>>,
    value: bool,
}

impl<'de, 'v> de::SeqAccess<'de> for MemoIdAccess<'v> {
    type Error = Error;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        if let Some(id) = self.id.take() {
            return seed.deserialize(de::value::U64Deserializer::<Error>::new(id.map_or(u64::MAX, u64::from)))
                .map(Some);
        }
        if mem::take(&mut self.value) {
            return seed.deserialize(self.walk).map(Some);
        }
        Ok(None)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(usize::from(self.id.is_some()) + usize::from(self.value))
    }
}

struct SeqAccess<'v> {
    walk: Walk<'v>,
    iter: std::slice::Iter<'v, Value>,
}

impl<'de, 'v> de::SeqAccess<'de> for SeqAccess<'v> {
    type Error = Error;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        match self.iter.next() {
            Some(value) => Ok(Some(seed.deserialize(self.walk.at(value))?)),
            None => Ok(None),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.iter.len())
    }
}

struct MapAccess<'v> {
    walk: Walk<'v>,
    iter: std::slice::Iter<'v, (Value, Value)>,
    value: Option<&'v Value>,
}

impl<'de, 'v> de::MapAccess<'de> for MapAccess<'v> {
    type Error = Error;

    fn next_key_seed<T: de::DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        match self.iter.next() {
            Some((key, value)) => {
                self.value = Some(value);
                Ok(Some(seed.deserialize(self.walk.at(key))?))
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<T: de::DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value> {
        let value = self.value.take().unwrap_or(&NONE_VALUE);
        seed.deserialize(self.walk.at(value))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.iter.len())
    }
}

/// Decodes a value from a `std::io::Read`.
pub fn from_reader<'de, R: io::Read, T: de::Deserialize<'de>>(rdr: R, options: DeOptions) -> Result<T> {
    let mut de = Deserializer::new(rdr, options);
    let value = de::Deserialize::deserialize(&mut de)?;
    // Make sure the whole stream has been consumed.
    de.end()?;
    Ok(value)
}

/// Decodes a value from a byte slice `&[u8]`.
pub fn from_slice<'de, T: de::Deserialize<'de>>(v: &[u8], options: DeOptions) -> Result<T> {
    from_reader(io::Cursor::new(v), options)
}

/// Decodes a value from any iterator supported as a reader.
pub fn from_iter<'de, E, I, T>(it: I, options: DeOptions) -> Result<T>
where
    E: IterReadItem,
    I: FusedIterator<Item = E>,
    T: de::Deserialize<'de>,
{
    from_reader(IterRead::new(it), options)
}

/// Decodes a value from a `std::io::Read`.
pub fn value_from_reader<R: io::Read>(rdr: R, options: DeOptions) -> Result<value::Value> {
    let mut de = Deserializer::new(rdr, options);
    let value = de.deserialize_value()?;
    de.end()?;
    Ok(value)
}

/// Decodes a value from a byte slice `&[u8]`.
pub fn value_from_slice(v: &[u8], options: DeOptions) -> Result<value::Value> {
    value_from_reader(io::Cursor::new(v), options)
}

/// Decodes a value from any iterator supported as a reader.
pub fn value_from_iter<E, I>(it: I, options: DeOptions) -> Result<value::Value>
where
    E: IterReadItem,
    I: FusedIterator<Item = E>,
{
    value_from_reader(IterRead::new(it), options)
}
