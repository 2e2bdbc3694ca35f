// Parser for the FusedElementwise program language, version 1 (docs/program-language.md).
#include "program.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <unordered_map>

#include "ops.h"

namespace onnxfuse {

namespace {

// ------------------------------------------------------------------ lexer
enum class Tok { Ident, Number, Punct, End };
struct Token {
  Tok kind;
  std::string text;
};

bool is_ident_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Strict number grammar: [+-]? ( decimal | hexfloat | inf | nan ), checked before strtod.
//   decimal : digits [. digits?] [(e|E) [+-]? digits] | . digits [(e|E) [+-]? digits]
//   hexfloat: 0(x|X) (hexdigits [. hexdigits?] | . hexdigits) (p|P) [+-]? digits
bool valid_number(const std::string& s) {
  size_t i = 0, n = s.size();
  if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
  std::string rest = s.substr(i);
  if (rest == "inf" || rest == "nan") return true;
  auto digits = [&](bool hex) {
    size_t st = i;
    while (i < n && (hex ? std::isxdigit(static_cast<unsigned char>(s[i])) : std::isdigit(static_cast<unsigned char>(s[i])))) ++i;
    return i - st;
  };
  bool hex = false;
  if (i + 1 < n && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'X')) {
    hex = true;
    i += 2;
  }
  size_t intd = digits(hex), fracd = 0;
  if (i < n && s[i] == '.') {
    ++i;
    fracd = digits(hex);
  }
  if (intd + fracd == 0) return false;
  if (hex) {
    if (i >= n || (s[i] != 'p' && s[i] != 'P')) return false;
    ++i;
    if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits(false) == 0) return false;
  } else if (i < n && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits(false) == 0) return false;
  }
  return i == n;
}

bool lex_line(const std::string& line, std::vector<Token>* toks, std::string* err) {
  size_t i = 0, n = line.size();
  while (i < n) {
    char c = line[i];
    if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') {
      ++i;
      continue;
    }
    if (is_ident_start(c)) {
      size_t st = i;
      while (i < n && is_ident_char(line[i])) ++i;
      toks->push_back({Tok::Ident, line.substr(st, i - st)});
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '+' || c == '-') {
      size_t st = i;
      ++i;
      bool hex = false;
      if (c == '+' || c == '-') {
        // a signed number or signed inf/nan
        if (i < n && is_ident_start(line[i])) {
          while (i < n && is_ident_char(line[i])) ++i;
          toks->push_back({Tok::Number, line.substr(st, i - st)});
          continue;
        }
      }
      while (i < n) {
        char d = line[i];
        if (d == 'x' || d == 'X') hex = true;
        if (is_ident_char(d) || d == '.') {
          ++i;
        } else if ((d == '+' || d == '-') &&
                   (hex ? (line[i - 1] == 'p' || line[i - 1] == 'P') : (line[i - 1] == 'e' || line[i - 1] == 'E'))) {
          ++i;
        } else {
          break;
        }
      }
      toks->push_back({Tok::Number, line.substr(st, i - st)});
      continue;
    }
    if (std::strchr(":=()[],", c) != nullptr) {
      toks->push_back({Tok::Punct, std::string(1, c)});
      ++i;
      continue;
    }
    *err = std::string("unexpected character '") + c + "'";
    return false;
  }
  toks->push_back({Tok::End, ""});
  return true;
}

struct ParseError {
  std::string msg;
};

class LineParser {
 public:
  explicit LineParser(std::vector<Token> t) : toks_(std::move(t)) {}
  const Token& peek(size_t k = 0) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  Token next() {
    Token t = peek();
    if (pos_ < toks_.size() - 1) ++pos_;
    return t;
  }
  bool at_punct(const char* p) const { return peek().kind == Tok::Punct && peek().text == p; }
  void expect_punct(const char* p, const char* what) {
    if (!at_punct(p)) throw ParseError{std::string("expected '") + p + "' " + what + ", found " + describe(peek())};
    next();
  }
  std::string expect_ident(const char* what) {
    if (peek().kind != Tok::Ident) throw ParseError{std::string("expected ") + what + ", found " + describe(peek())};
    return next().text;
  }
  void expect_end() {
    if (peek().kind != Tok::End) throw ParseError{"unexpected " + describe(peek()) + " at end of statement"};
  }
  static std::string describe(const Token& t) {
    if (t.kind == Tok::End) return "end of line";
    return "'" + t.text + "'";
  }

 private:
  std::vector<Token> toks_;
  size_t pos_ = 0;
};

double parse_number_text(const std::string& s) {
  if (!valid_number(s)) throw ParseError{"invalid number '" + s + "'"};
  std::string body = s;
  bool neg = false;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    neg = body[0] == '-';
    body = body.substr(1);
  }
  double v;
  if (body == "inf") {
    v = HUGE_VAL;
  } else if (body == "nan") {
    v = std::nan("");
  } else {
    errno = 0;
    char* end = nullptr;
    v = std::strtod(body.c_str(), &end);
    if (end == nullptr || *end != '\0') throw ParseError{"invalid number '" + s + "'"};
    // strtod gives +-HUGE_VAL on overflow, like Python's float() gives inf... Python raises
    // OverflowError only for int(); float('1e999') is inf. Accept it the same way.
  }
  return neg ? -v : v;
}

bool is_plain_integer(const std::string& s) {
  size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i >= s.size()) return false;
  for (size_t k = i; k < s.size(); ++k)
    if (!std::isdigit(static_cast<unsigned char>(s[k]))) return false;
  return true;
}

// What an op's operands must be, for messages: "float", "numeric (float or int)", "bool".
std::string dtypes_text(unsigned mask) {
  const unsigned floats = 0x07, ints = 0x18, boolean = 0x20;
  if (mask == floats) return "float";
  if (mask == (floats | ints)) return "numeric (float or int)";
  if (mask == boolean) return "bool";
  std::string s;
  for (int i = 0; i < kNumDTypes; ++i)
    if (mask & (1u << i)) s += (s.empty() ? "" : " or ") + std::string(kDTypeNames[i]);
  return s;
}

// "'none' or 'tanh'" from "none|tanh"; sets *index to the position of `word` (-1 if absent).
std::string choices_text(const char* choices, const std::string& word, int* index) {
  std::string all(choices), text;
  *index = -1;
  size_t st = 0;
  for (int k = 0; st <= all.size(); ++k) {
    size_t e = all.find('|', st);
    if (e == std::string::npos) e = all.size();
    const std::string w = all.substr(st, e - st);
    if (w == word) *index = k;
    text += (text.empty() ? "'" : (e == all.size() ? " or '" : ", '")) + w + "'";
    st = e + 1;
  }
  return text;
}

// float64 -> float32/float16/bfloat16, rounded once to nearest even (as numpy does). For the
// 16-bit types go through float32 rounded to odd, which makes the double rounding exact.
double round_to_float_dtype(double d, DType t) {
  float f = static_cast<float>(d);
  if (t == DType::F32 || std::isnan(d) || std::isinf(f)) {
    if (t == DType::F32 || std::isnan(d)) return f;
  }
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // toward zero
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;  // sticky: round to odd
    std::memcpy(&f, &u, 4);
  }
  if (t == DType::F16) return ofx_h2f(ofx_f2h(f));
  return ofx_bf2f(ofx_f2bf(f));
}

// Round a float constant to its storage dtype; check integer constants.
void set_const_value(Value* v, const std::string& text) {
  if (is_float(v->dtype)) {
    v->fconst = round_to_float_dtype(parse_number_text(text), v->dtype);
    return;
  }
  int64_t iv;
  if (is_plain_integer(text)) {
    errno = 0;
    long long ll = std::strtoll(text.c_str(), nullptr, 10);
    if (errno == ERANGE) throw ParseError{"constant " + text + " is out of range for " + dtype_name(v->dtype)};
    iv = ll;
  } else {
    parse_number_text(text);  // reports malformed numbers first
    throw ParseError{"constant of dtype " + std::string(dtype_name(v->dtype)) + " must be an integer literal, got " + text};
  }
  if (v->dtype == DType::I32 && (iv < INT32_MIN || iv > INT32_MAX))
    throw ParseError{"constant " + text + " is out of range for int32"};
  if (v->dtype == DType::BOOL && iv != 0 && iv != 1)
    throw ParseError{"bool constant must be 0 or 1, got " + text};
  v->iconst = iv;
}

}  // namespace

// ------------------------------------------------------------------ dtype helpers
const char* dtype_name(DType t) { return kDTypeNames[static_cast<int>(t)]; }
bool dtype_from_name(const std::string& s, DType* out) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (s == kDTypeNames[i]) {
      *out = static_cast<DType>(i);
      return true;
    }
  return false;
}
bool is_float(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }
bool is_int(DType t) { return t == DType::I32 || t == DType::I64; }
size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::I64: return 8;
    case DType::BOOL: return 1;
  }
  return 0;
}
int dtype_to_onnx(DType t) {
  switch (t) {
    case DType::F32: return 1;
    case DType::F16: return 10;
    case DType::BF16: return 16;
    case DType::I32: return 6;
    case DType::I64: return 7;
    case DType::BOOL: return 9;
  }
  return 0;
}
bool dtype_from_onnx(int onnx, DType* out) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (dtype_to_onnx(static_cast<DType>(i)) == onnx) {
      *out = static_cast<DType>(i);
      return true;
    }
  return false;
}

// ------------------------------------------------------------------ parser
bool parse_program(const std::string& text, Program* out, std::string* err) {
  Program prog;
  prog.text = text;
  std::unordered_map<std::string, int> names;
  std::map<std::string, Op> op_by_name;
  for (int i = 0; i < static_cast<int>(Op::NumOps); ++i) op_by_name[kOps[i].name] = static_cast<Op>(i);

  enum Stage { kHeader, kInputs, kOps, kOutputs } stage = kHeader;
  int lineno = 0, last_nonblank = 1;
  size_t pos = 0;
  try {
    while (pos <= text.size()) {
      size_t nl = text.find('\n', pos);
      if (nl == std::string::npos) nl = text.size();
      std::string line = text.substr(pos, nl - pos);
      pos = nl + 1;
      ++lineno;
      size_t hash = line.find('#');
      if (hash != std::string::npos) line = line.substr(0, hash);
      std::vector<Token> toks;
      std::string lex_err;
      if (!lex_line(line, &toks, &lex_err)) throw ParseError{lex_err};
      if (toks.size() == 1) continue;  // blank
      last_nonblank = lineno;
      LineParser p(std::move(toks));

      if (stage == kHeader) {
        // onnxfuse.elementwise VERSION  -> lexed as Ident("onnxfuse") Number(".elementwise")? No:
        // '.' starts a number token, so match the raw text instead.
        std::string s = line;
        size_t a = s.find_first_not_of(" \t\r\f\v");
        size_t b = s.find_last_not_of(" \t\r\f\v");
        s = s.substr(a, b - a + 1);
        const std::string magic = kProgramHeader;
        const std::string expected_header = "expected header '" + magic + " " + std::to_string(kLanguageVersion) + "'";
        if (s.compare(0, magic.size(), magic) != 0 ||
            (s.size() > magic.size() && s[magic.size()] != ' ' && s[magic.size()] != '\t'))
          throw ParseError{expected_header};
        std::string ver = s.substr(magic.size());
        size_t va = ver.find_first_not_of(" \t");
        ver = va == std::string::npos ? "" : ver.substr(va);
        bool digits = is_plain_integer(ver);
        if (!digits) throw ParseError{"expected a language version number after '" + magic + "'"};
        std::string vdig = ver;
        if (!vdig.empty() && (vdig[0] == '+' || vdig[0] == '-')) vdig = vdig.substr(1);
        size_t nz = vdig.find_first_not_of('0');
        bool supported = ver[0] != '-' && nz != std::string::npos && vdig.substr(nz) == std::to_string(kLanguageVersion);
        if (!supported)
          throw ParseError{"unsupported program language version " + ver + " (this build reads version " +
                           std::to_string(kLanguageVersion) + ")"};
        stage = kInputs;
        continue;
      }

      const Token& t0 = p.peek();
      bool kw = t0.kind == Tok::Ident && p.peek(1).kind == Tok::Ident;
      auto define = [&](const std::string& name) {
        if (name == "input" || name == "const" || name == "output" || name == "inf" || name == "nan")
          throw ParseError{"'" + name + "' is a reserved word and cannot name a value"};
        if (names.count(name)) throw ParseError{"'" + name + "' is already defined"};
        names[name] = static_cast<int>(prog.values.size());
      };
      auto read_dtype = [&]() {
        std::string d = p.expect_ident("a dtype");
        DType t;
        if (!dtype_from_name(d, &t)) throw ParseError{"unknown dtype '" + d + "'"};
        return t;
      };
      auto lookup = [&](const std::string& name) {
        auto it = names.find(name);
        if (it == names.end()) throw ParseError{"'" + name + "' is not defined"};
        return it->second;
      };

      if (kw && t0.text == "input") {
        if (stage != kInputs) throw ParseError{"input declarations must come before operations and outputs"};
        p.next();
        std::string name = p.expect_ident("an input name");
        p.expect_punct(":", "after the input name");
        DType t = read_dtype();
        p.expect_end();
        define(name);
        Value v{Value::kInput, name, t};
        v.input_index = static_cast<int>(prog.inputs.size());
        prog.inputs.push_back(static_cast<int>(prog.values.size()));
        prog.values.push_back(v);
      } else if (kw && t0.text == "const") {
        if (stage == kOutputs) throw ParseError{"const after an output line (output lines come last)"};
        p.next();
        std::string name = p.expect_ident("a constant name");
        p.expect_punct(":", "after the constant name");
        DType t = read_dtype();
        p.expect_punct("=", "after the constant's dtype");
        Token num = p.next();
        if (num.kind != Tok::Number && !(num.kind == Tok::Ident && (num.text == "inf" || num.text == "nan")))
          throw ParseError{"expected a number, found " + LineParser::describe(num)};
        p.expect_end();
        Value v{Value::kConst, name, t};
        set_const_value(&v, num.text);
        define(name);
        prog.values.push_back(v);
      } else if (kw && t0.text == "output") {
        p.next();
        std::string name = p.expect_ident("an output name");
        p.expect_end();
        prog.outputs.push_back(lookup(name));
        stage = kOutputs;
      } else {
        // NAME: DTYPE = OP[attrs](args)
        if (stage == kOutputs) throw ParseError{"operations must come before outputs"};
        if (prog.inputs.empty()) throw ParseError{"a program needs at least one input before its operations"};
        stage = kOps;
        std::string name = p.expect_ident("a statement ('input', 'const', 'output' or NAME: DTYPE = OP(...))");
        p.expect_punct(":", "after the result name");
        DType t = read_dtype();
        p.expect_punct("=", "after the result dtype");
        std::string opname = p.expect_ident("an op name");
        auto oit = op_by_name.find(opname);
        if (oit == op_by_name.end()) throw ParseError{"unknown op '" + opname + "'"};
        Op op = oit->second;
        Instr ins;
        ins.op = op;
        std::map<std::string, Token> attrs;
        if (p.at_punct("[")) {
          p.next();
          while (true) {
            std::string key = p.expect_ident("an attribute name");
            p.expect_punct("=", "after the attribute name");
            Token val = p.next();
            if (val.kind != Tok::Number && val.kind != Tok::Ident)
              throw ParseError{"expected an attribute value, found " + LineParser::describe(val)};
            if (attrs.count(key)) throw ParseError{"attribute '" + key + "' given twice"};
            attrs[key] = val;
            if (p.at_punct(",")) {
              p.next();
              continue;
            }
            p.expect_punct("]", "to close the attribute list");
            break;
          }
        }
        p.expect_punct("(", "before the arguments");
        if (!p.at_punct(")")) {
          while (true) {
            ins.args.push_back(lookup(p.expect_ident("an argument name")));
            if (p.at_punct(",")) {
              p.next();
              continue;
            }
            break;
          }
        }
        p.expect_punct(")", "after the arguments");
        p.expect_end();
        const OpInfo& info = op_info(op);
        if (static_cast<int>(ins.args.size()) != info.arity)
          throw ParseError{std::string(info.name) + " takes " + std::to_string(info.arity) + " argument" +
                           (info.arity == 1 ? "" : "s") + ", got " + std::to_string(ins.args.size())};
        // attributes (the row's, in order; numeric ones go to ins.a, ins.b)
        double nums[2] = {0, 0};
        std::string num_text[2];
        int ni = 0;
        for (const auto& kv : attrs) {
          bool known = false;
          for (int k = 0; k < info.nattrs; ++k) known = known || kv.first == info.attrs[k].name;
          if (!known) throw ParseError{std::string(info.name) + " has no attribute '" + kv.first + "'"};
        }
        for (int k = 0; k < info.nattrs; ++k) {
          const AttrInfo& s = info.attrs[k];
          auto it = attrs.find(s.name);
          if (it == attrs.end() && s.required)
            throw ParseError{std::string(info.name) + " needs attribute '" + s.name + "'"};
          switch (s.kind) {
            case AttrKind::kFloat:
            case AttrKind::kBound: {
              double v = s.def;
              if (it != attrs.end()) {
                const Token& tv = it->second;
                if (tv.kind == Tok::Ident && tv.text != "inf" && tv.text != "nan")
                  throw ParseError{std::string("attribute '") + s.name + "' of " + info.name + " must be a number, got '" + tv.text + "'"};
                v = parse_number_text(tv.text);
                num_text[ni] = tv.text;
              }
              nums[ni++] = v;
              break;
            }
            case AttrKind::kDtype:
              if (it != attrs.end() && (it->second.kind != Tok::Ident || !dtype_from_name(it->second.text, &ins.to)))
                throw ParseError{std::string("attribute '") + s.name + "' of " + info.name + " must be a dtype, got '" +
                                 it->second.text + "'"};
              break;
            case AttrKind::kWord: {
              const std::string w = it != attrs.end() ? it->second.text : s.def_word;
              int index;
              const std::string allowed = choices_text(s.choices, w, &index);
              if (index < 0 || (it != attrs.end() && it->second.kind != Tok::Ident))
                throw ParseError{std::string("attribute '") + s.name + "' of " + info.name + " must be " + allowed +
                                 ", got '" + w + "'"};
              if (op == Op::Gelu) ins.approximate_tanh = w == "tanh";
              break;
            }
          }
        }
        ins.a = nums[0];
        ins.b = nums[1];
        // types: operands (after Where's condition) share one dtype of the row's; result by rule
        std::vector<DType> at;
        for (int a : ins.args) at.push_back(prog.values[a].dtype);
        const size_t d0 = info.cond_first ? 1 : 0;
        if (info.cond_first && at[0] != DType::BOOL)
          throw ParseError{std::string(info.name) + "'s condition must be bool, got " + dtype_name(at[0])};
        for (size_t k = d0 + 1; k < at.size(); ++k)
          if (at[k] != at[d0])
            throw ParseError{std::string(info.name) + " operands must share one dtype, got " + dtype_name(at[d0]) +
                             " and " + dtype_name(at[k])};
        if (!(info.dtypes & (1u << static_cast<int>(at[d0]))))
          throw ParseError{std::string(info.name) + " needs " + dtypes_text(info.dtypes) + " operands, got " +
                           dtype_name(at[d0])};
        const DType rt = info.result == ResultRule::kBool ? DType::BOOL : info.result == ResultRule::kTo ? ins.to : at[d0];
        if (op == Op::Clip) {
          if (is_float(at[0])) {  // bounds are values of the operand's dtype
            ins.a = round_to_float_dtype(ins.a, at[0]);
            ins.b = round_to_float_dtype(ins.b, at[0]);
          } else {
            double lim_lo = at[0] == DType::I32 ? -2147483648.0 : -9223372036854775808.0;
            double lim_hi = at[0] == DType::I32 ? 2147483647.0 : 9223372036854775807.0;
            double bounds[2] = {ins.a, ins.b};
            int64_t ib[2];
            for (int k = 0; k < 2; ++k) {
              double d = bounds[k];
              if (!num_text[k].empty() && !std::isinf(d) && !is_plain_integer(num_text[k]))
                throw ParseError{std::string("attribute ") + (k ? "max" : "min") + " of Clip must be an integer literal for " +
                                 dtype_name(at[0]) + ", got " + num_text[k]};
              if (std::isinf(d)) {
                ib[k] = d < 0 ? (at[0] == DType::I32 ? INT32_MIN : INT64_MIN) : (at[0] == DType::I32 ? INT32_MAX : INT64_MAX);
              } else {
                errno = 0;
                long long ll = std::strtoll(num_text[k].c_str(), nullptr, 10);
                if (errno == ERANGE || static_cast<double>(ll) < lim_lo || static_cast<double>(ll) > lim_hi ||
                    (at[0] == DType::I32 && (ll < INT32_MIN || ll > INT32_MAX)))
                  throw ParseError{std::string("attribute ") + (k ? "max" : "min") + " of Clip: " + num_text[k] +
                                   " is out of range for " + dtype_name(at[0])};
                ib[k] = ll;
              }
            }
            ins.ilo = ib[0];
            ins.ihi = ib[1];
          }
        }
        if (t != rt)
          throw ParseError{"'" + name + "' is declared " + dtype_name(t) + " but " + info.name + " gives " + dtype_name(rt)};
        define(name);
        ins.result = static_cast<int>(prog.values.size());
        prog.values.push_back(Value{Value::kOp, name, t});
        prog.instrs.push_back(ins);
      }
    }
  } catch (const ParseError& e) {
    *err = "line " + std::to_string(lineno) + ": " + e.msg;
    return false;
  }
  if (stage == kHeader) {
    *err = "line 1: expected header '" + std::string(kProgramHeader) + " " + std::to_string(kLanguageVersion) +
           "' (the program is empty)";
    return false;
  }
  if (prog.inputs.empty()) {
    *err = "line " + std::to_string(last_nonblank) + ": a program needs at least one input";
    return false;
  }
  if (prog.outputs.empty()) {
    *err = "line " + std::to_string(last_nonblank) + ": a program needs at least one output";
    return false;
  }
  *out = std::move(prog);
  return true;
}

}  // namespace onnxfuse
