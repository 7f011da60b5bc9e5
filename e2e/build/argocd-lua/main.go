// argocd-lua runs an Argo CD resource health script in gopher-lua the way Argo CD's
// util/lua (VM.runLua + VM.ExecuteHealthLua) does, so the script can be tested without Argo CD:
//
//	argocd-lua [-open-libs] health.lua object.json   -> {"status": "...", "message": "..."}
//
// What it mirrors:
//   - a Lua state without the standard libraries (SkipOpenLibs) unless -open-libs: scripts from
//     argocd-cm run that way unless resource.customizations.useOpenLibs.<group_kind> is true;
//     then package, base and table are opened (Argo CD also opens its own "safe" os library,
//     which this script does not use and is left out here);
//   - a 1s timeout on the script (Argo CD's context);
//   - obj: the live object as Argo CD's decodeValue builds it from an unstructured object
//     (JSON numbers arrive as int64 or float64 and become Lua numbers; arrays become sequences,
//     objects tables keyed by strings, null nil);
//   - the value left on the stack must be a table; it is encoded with layeh.com/gopher-json
//     (Argo CD's luajson) and the status must be one of Argo CD's health codes, else Unknown
//     with "Lua returned an invalid health status".
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	lua "github.com/yuin/gopher-lua"
	luajson "layeh.com/gopher-json"
)

type healthStatus struct {
	Status  string `json:"status,omitempty"`
	Message string `json:"message,omitempty"`
}

var validStatus = map[string]bool{
	"Unknown": true, "Progressing": true, "Suspended": true, "Healthy": true, "Degraded": true, "Missing": true,
}

// toUnstructured turns json.Numbers into int64 (integers) or float64, as apimachinery's
// unstructured JSON decoding does.
func toUnstructured(v any) (any, error) {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i, nil
		}
		return x.Float64()
	case []any:
		for i := range x {
			c, err := toUnstructured(x[i])
			if err != nil {
				return nil, err
			}
			x[i] = c
		}
	case map[string]any:
		for k := range x {
			c, err := toUnstructured(x[k])
			if err != nil {
				return nil, err
			}
			x[k] = c
		}
	}
	return v, nil
}

// toLua builds Lua values from an unstructured object, case by case as Argo CD's decodeValue.
func toLua(L *lua.LState, value any) lua.LValue {
	switch v := value.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []any:
		t := L.CreateTable(len(v), 0)
		for _, item := range v {
			t.Append(toLua(L, item))
		}
		return t
	case map[string]any:
		t := L.CreateTable(0, len(v))
		for k, item := range v {
			t.RawSetH(lua.LString(k), toLua(L, item))
		}
		return t
	}
	return lua.LNil
}

func run(scriptPath, objPath string, openLibs bool) (*healthStatus, error) {
	script, err := os.ReadFile(scriptPath)
	if err != nil {
		return nil, err
	}
	raw, err := os.ReadFile(objPath)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var obj map[string]any
	if err := dec.Decode(&obj); err != nil {
		return nil, fmt.Errorf("%s: %w", objPath, err)
	}
	converted, err := toUnstructured(obj)
	if err != nil {
		return nil, err
	}

	L := lua.NewState(lua.Options{SkipOpenLibs: !openLibs})
	defer L.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable}} {
		if err := L.CallByParam(lua.P{Fn: L.NewFunction(lib.open), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	L.SetContext(ctx)
	L.SetGlobal("obj", toLua(L, converted))
	if err := L.DoString(string(script)); err != nil {
		return nil, err
	}
	ret := L.Get(-1)
	if ret.Type() != lua.LTTable {
		return nil, fmt.Errorf("expect table output from Lua script, not %s", ret.Type())
	}
	out, err := luajson.Encode(ret)
	if err != nil {
		return nil, err
	}
	hs := &healthStatus{}
	if err := json.Unmarshal(out, hs); err != nil {
		return nil, err
	}
	if !validStatus[hs.Status] {
		return &healthStatus{Status: "Unknown", Message: "Lua returned an invalid health status"}, nil
	}
	return hs, nil
}

func main() {
	openLibs := flag.Bool("open-libs", false, "open all of gopher-lua's standard libraries (resource.customizations.useOpenLibs)")
	flag.Parse()
	if flag.NArg() != 2 {
		fmt.Fprintln(os.Stderr, "usage: argocd-lua [-open-libs] health.lua object.json")
		os.Exit(2)
	}
	hs, err := run(flag.Arg(0), flag.Arg(1), *openLibs)
	if err != nil {
		fmt.Fprintln(os.Stderr, "argocd-lua:", err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(hs); err != nil {
		os.Exit(1)
	}
}
